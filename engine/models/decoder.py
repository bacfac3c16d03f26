"""One decoder for Llama, Qwen2 and Mistral: RMSNorm, RoPE (default / linear / llama3), GQA, SwiGLU.

Differences between the families are data in ModelConfig (q/k/v biases, tied embeddings, rope scaling).
Tokens of all sequences in a step are flattened: hidden states are [T, hidden].
"""
import contextlib
import math

import torch
from torch import nn

from quant_serve.engine.attention import AttentionMetadata, paged_attention_forward
from quant_serve.engine.config import ModelConfig
from quant_serve.kernels.attention_merge import DecodePartials
from quant_serve.kernels.gemv import gemv, gemv_applies
from quant_serve.kernels.gpu import options_for
from quant_serve.kernels.norm_act import rms_norm
from quant_serve.kernels.w4a16.fold import FoldedNorm
from quant_serve.quant.linear import DenseLinear, make_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, H] -> normed; with residual: (normed(x + residual), x + residual) in one kernel on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """The cos/sin table of neox-style RoPE (rotate_half, as in the HF Llama/Qwen2 code), computed in fp32 like HF:
    cos_sin_cache[pos] = cat(cos, sin) [D]. The rotation itself runs in kernels.paged_attention.rope_store_kv."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                                     # [max_pos, D/2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)                # [max_pos, D]
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device, quant_config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias, dtype, device,
                                    quant_config, [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj = make_linear(q_size, [cfg.hidden_size], False, dtype, device, quant_config, [f"{prefix}.o_proj"])
        self.split_sizes = [q_size, kv_size, kv_size]
        self.softmax_scale = cfg.head_dim ** -0.5
        # Set by the model runner once the KV cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rotary: RotaryEmbedding) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), meta, rotary))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
               rotary: RotaryEmbedding, merge: bool = True) -> torch.Tensor | DecodePartials:
        """qkv [T, (Hq + 2 Hkv) D] -> the attention output before o_proj [T, Hq D]; merge False: a decode step
        may return the decode kernel's split partials instead (o_proj.forward_residual merges them)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention_forward(q, k, v, positions, rotary.cos_sin_cache, self.k_cache, self.v_cache,
                                      self.k_scale, self.v_scale, meta, self.softmax_scale, merge)
        return out if isinstance(out, DecodePartials) else out.reshape(num_tokens, -1)     # [T, Hq D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device, quant_config):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        inter = cfg.intermediate_size
        self.gate_up_proj = make_linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, dtype, device, quant_config,
                                        [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = make_linear(inter, [cfg.hidden_size], cfg.mlp_bias, dtype, device, quant_config,
                                     [f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_mul(x))                  # silu(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device, quant_config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, f"{prefix}.self_attn", dtype, device, quant_config)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, f"{prefix}.mlp", dtype, device, quant_config)

    def forward(self, positions, x, residual, meta, rotary):
        """x: this layer's input delta [T, H], residual: the stream before it (None for the first layer).
        -> (the MLP output, the stream before it); their sum is the layer's output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, quant_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, f"model.layers.{i}", dtype, device, quant_config)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      device)

    @contextlib.contextmanager
    def first_layers(self, n: int):
        """Inside, the model runs its first n layers only: every kernel variant of a step is launched by the first
        two (the first layer of the folded path is special), so compiling them needs no more."""
        layers = self.layers
        self.layers = layers[:n]
        try:
            yield
        finally:
            self.layers = layers

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        if x.shape[0] == 1 and self._norms_fold(x):
            return self._forward_folded(x, positions, meta)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta, self.rotary)
        return self.norm(x, residual)[0]

    def _norms_fold(self, x: torch.Tensor) -> bool:
        """On CUDA with KernelOptions.fold_norms, every INT4 matmul of the model can fold the RMSNorms around it
        (QuantLinear.folds_norm)."""
        if not x.is_cuda or not options_for(x.device).fold_norms:
            return False
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear, silu_mul in ((attn.qkv_proj, False), (attn.o_proj, False), (mlp.gate_up_proj, True),
                                     (mlp.down_proj, False)):
                if not (hasattr(linear, "folds_norm") and linear.folds_norm(silu_mul)):
                    return False
        return True

    def _forward_folded(self, x: torch.Tensor, positions, meta) -> torch.Tensor:
        """One token (batch-1 decode) with the RMSNorms folded into the matmuls: o_proj and down_proj add the
        residual in their epilogue and leave the stream's sums of squares by 64 columns; qkv_proj and gate_up_proj
        normalize the stream as they stage it. Two launches a layer fewer than forward's path (its norm kernels),
        same roundings; the variance is summed in another order (fp32). o_proj also merges the decode kernel's
        split partials as it stages them (one launch a layer fewer; KernelOptions.fold_merge off: the merge kernel)."""
        merge = not options_for(x.device).fold_merge
        residual = x
        qkv = self.layers[0].self_attn.qkv_proj(self.layers[0].input_layernorm(x))
        ss = None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if i > 0:
                qkv = attn.qkv_proj.forward_normed(residual, _folded(ss, layer.input_layernorm))
            a = attn.attend(positions, qkv, meta, self.rotary, merge)
            residual, ss = attn.o_proj.forward_residual(a, residual)
            act = mlp.gate_up_proj.forward_normed(residual, _folded(ss, layer.post_attention_layernorm), True)
            residual, ss = mlp.down_proj.forward_residual(act, residual)
        return self.norm(residual)


class DecoderForCausalLM(nn.Module):
    # checkpoint module name -> (our merged module name, shard index)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, quant_config=None):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype, device, quant_config)
        if cfg.tie_word_embeddings and not _quantized_head(quant_config):
            self.lm_head = None
        else:
            # INT4 where the checkpoint quantized it (GPTQ `lm_head: true`, compressed-tensors without lm_head in
            # `ignore`): a quarter of the bytes every decode step reads for the head (1.09 GB in FP16 on Qwen2.5-7B)
            self.lm_head = make_linear(cfg.hidden_size, [cfg.vocab_size], False, dtype, device, quant_config,
                                       ["lm_head"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden: [S, hidden] -> logits [S, vocab], fp32 or (float32=False) in the model's dtype. A dense head at
        one row (batch-1 decode) streams through kernels/gemv.py (faster than cuBLAS's pick there)."""
        dense = self.model.embed_tokens.weight if self.lm_head is None else (
            self.lm_head.weight if isinstance(self.lm_head, DenseLinear) and self.lm_head.bias is None else None)
        if dense is not None and gemv_applies(hidden, dense):
            logits = gemv(hidden, dense)
        elif self.lm_head is None:
            logits = nn.functional.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]


def _folded(ss: torch.Tensor, norm: RMSNorm) -> FoldedNorm:
    return FoldedNorm(ss, norm.weight, norm.eps)


def _quantized_head(quant_config) -> bool:
    """A tied model whose checkpoint still carries a quantized lm_head (quantizers untie the head they quantize)."""
    names = getattr(quant_config, "tensor_names", None)
    return names is not None and f"lm_head.{quant_config.marker}" in names
