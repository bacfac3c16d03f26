"""One decoder for Llama, Qwen2/3, Mistral, Gemma 2/3 and Phi-3: RMSNorm, RoPE, GQA, a gated MLP.

Differences between the families are data in ModelConfig (q/k/v biases, q/k norms, the norm style and placement,
SwiGLU or GeGLU, soft-caps, per-layer sliding windows, embedding scale, tied embeddings, rope scaling, fused
checkpoint projections); the small pieces live in layers.py. Tokens of all sequences in a step are flattened:
hidden states are [T, hidden]. The dense_* methods are the same layers without paging ([B, L, hidden], positions
0..L-1, plain causal attention, no KV cache) in the stages the quantizers observe (engine/models/dense_calib.py).
"""
import contextlib

import torch
from torch import nn

from quant_serve.engine.worker.attention import AttentionMetadata, paged_attention_forward
from quant_serve.engine.config import ModelConfig
from quant_serve.engine.models import fused_decode
from quant_serve.engine.models.layers import (GELU_ACTS, SILU_ACTS, RMSNorm, RotaryEmbedding, gelu_tanh_and_mul,
                                              make_norm, rope_inv_freq)
from quant_serve.kernels.attention.merge import DecodePartials
from quant_serve.kernels.gemv import gemv, gemv_applies
from quant_serve.kernels.norm_act import rms_norm_ref, silu_and_mul_ref
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import make_linear

__all__ = ["DecoderForCausalLM", "DecoderModel", "RMSNorm", "RotaryEmbedding", "rope_inv_freq"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, prefix: str, dtype, device, quant_config):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if cfg.fused_checkpoint:       # Phi-3: one qkv_proj module in the checkpoint
            self.qkv_proj = make_linear(cfg.hidden_size, [q_size + 2 * kv_size], cfg.attention_bias, dtype, device,
                                        quant_config, [f"{prefix}.qkv_proj"])
        else:
            self.qkv_proj = make_linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias, dtype,
                                        device, quant_config, [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj = make_linear(q_size, [cfg.hidden_size], False, dtype, device, quant_config, [f"{prefix}.o_proj"])
        self.split_sizes = [q_size, kv_size, kv_size]
        self.softmax_scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_logit_softcap
        self.q_norm = make_norm(cfg, cfg.head_dim, dtype, device) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim, dtype, device) if cfg.qk_norm else None
        # Set by the model runner once the KV cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        # an integer cache's k_scale / v_scale are its per-block scales; a rotated one sets the Hadamard matrix
        self.kv_rotation: torch.Tensor | None = None
        self.kv_rings: tuple[torch.Tensor, torch.Tensor] | None = None     # its exact window (K, V rings)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                rotary: RotaryEmbedding) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(x), meta, rotary))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
               rotary: RotaryEmbedding, merge: bool = True) -> torch.Tensor | DecodePartials:
        """qkv [T, (Hq + 2 Hkv) D] -> the attention output before o_proj [T, Hq D]; merge False: a decode step
        may return the decode kernel's split partials instead (engine/models/fused_decode.py's o_proj merges them)."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:                     # per head, before RoPE
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention_forward(q, k, v, positions, rotary.cos_sin_cache, self.k_cache, self.v_cache,
                                      self.k_scale, self.v_scale, meta, self.softmax_scale, merge,
                                      window=self.window, softcap=self.softcap, rotation=self.kv_rotation,
                                      rings=self.kv_rings)
        return out if isinstance(out, DecodePartials) else out.reshape(num_tokens, -1)     # [T, Hq D]

    def dense_attend(self, qkv: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Non-paged: qkv [B, L, (Hq + 2 Hkv) D] of tokens at positions 0..L-1, cos_sin the rotary table's first L
        rows -> causal attention output before o_proj [B, L, Hq D]."""
        b, seq, _ = qkv.shape
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(b, seq, self.num_heads, self.head_dim)
        k = k.view(b, seq, self.num_kv_heads, self.head_dim)
        v = v.view(b, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = dense_norm(self.q_norm, q), dense_norm(self.k_norm, k)
        q, k = _rotate(q.transpose(1, 2), cos_sin), _rotate(k.transpose(1, 2), cos_sin)     # [B, H, L, D]
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        window = self.window if 0 < self.window < seq else 0
        if not window and not self.softcap:
            # torch's own 1/sqrt(D) unless the model sets another scale (Gemma)
            scale = None if self.softmax_scale == self.head_dim ** -0.5 else self.softmax_scale
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:                                   # a tanh soft-cap or a window SDPA cannot express
            scores = (q @ k.transpose(-1, -2)).float() * self.softmax_scale                # [B, H, L, L]
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            pos = torch.arange(seq, device=q.device)
            visible = pos[None, :] <= pos[:, None]
            if window:
                visible &= pos[None, :] > pos[:, None] - window
            out = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(v.dtype) @ v
        return out.transpose(1, 2).reshape(b, seq, -1)                                   # [B, L, Hq D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, dtype, device, quant_config):
        super().__init__()
        if cfg.hidden_act not in SILU_ACTS + GELU_ACTS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu, gelu_pytorch_tanh)")
        self.silu = cfg.hidden_act in SILU_ACTS
        inter = cfg.intermediate_size
        sources = [f"{prefix}.gate_up_proj"] if cfg.fused_checkpoint else [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_proj = make_linear(cfg.hidden_size, [2 * inter] if cfg.fused_checkpoint else [inter, inter],
                                        cfg.mlp_bias, dtype, device, quant_config, sources)
        self.down_proj = make_linear(inter, [cfg.hidden_size], cfg.mlp_bias, dtype, device, quant_config,
                                     [f"{prefix}.down_proj"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu:
            return self.down_proj(self.gate_up_proj.forward_silu_mul(x))              # silu(gate) * up
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))

    def dense_act(self, m: torch.Tensor) -> torch.Tensor:
        """Non-paged: m [.., H] -> the gated activation, down_proj's input [.., I] (plain torch on any device)."""
        gate_up = self.gate_up_proj(m)
        return silu_and_mul_ref(gate_up) if self.silu else gelu_tanh_and_mul(gate_up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, device, quant_config):
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype, device)
        self.self_attn = Attention(cfg, layer, f"{prefix}.self_attn", dtype, device, quant_config)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype, device)
        self.mlp = MLP(cfg, f"{prefix}.mlp", dtype, device, quant_config)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, device)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size, dtype, device)
        self.sandwich = cfg.sandwich_norms

    def forward(self, positions, x, residual, meta, rotary):
        """x: this layer's input delta [T, H], residual: the stream before it (None for the first layer).
        -> (the MLP output, the stream before it); their sum is the layer's output."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, rotary)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        # Gemma: the attention output is normed before the residual add, the MLP has a norm on either side
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual

    # ---- non-paged, in the quantizers' stages (quant/block.py): x [B, L, H] at positions 0..L-1 ----

    def dense_attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return dense_norm(self.input_layernorm, x)

    def dense_attn_core(self, a: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.self_attn.dense_attend(self.self_attn.qkv_proj(a), cos_sin)

    def dense_mlp_input(self, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the residual stream after attention, the MLP's input)."""
        out = self.self_attn.o_proj(o)
        if not self.sandwich:
            h = x + out
            return h, dense_norm(self.post_attention_layernorm, h)
        h = x + dense_norm(self.post_attention_layernorm, out)
        return h, dense_norm(self.pre_feedforward_layernorm, h)

    def dense_block_output(self, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        out = self.mlp.down_proj(d)
        return h + (dense_norm(self.post_feedforward_layernorm, out) if self.sandwich else out)

    def dense_forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        h, m = self.dense_mlp_input(x, self.dense_attn_core(self.dense_attn_input(x), cos_sin))
        return self.dense_block_output(h, self.mlp.dense_act(m))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, device, quant_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        # Gemma multiplies by sqrt(hidden) rounded to the model dtype, as transformers does
        self.embed_scale = None if cfg.embed_scale is None else \
            torch.tensor(cfg.embed_scale, dtype=dtype, device="cpu").item()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, quant_config) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, dtype, device)
        self.rotary, self.local_rotary = make_rotaries(cfg, device)
        self.folds_norms = cfg.llama_block

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
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if fused_decode.applies(self, x):                   # batch-1 decode: the norms folded into the matmuls
            return fused_decode.forward(self, x, positions, meta)
        for layer in self.layers:
            rotary = self.local_rotary if layer.self_attn.window else self.rotary
            x, residual = layer(positions, x, residual, meta, rotary)
        return self.norm(x, residual)[0]


def make_rotaries(cfg: ModelConfig, device) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """-> (the global layers' rotary table, the sliding-window layers')."""
    rotary_dim = cfg.rotary_dim or cfg.head_dim
    rotary = RotaryEmbedding(rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device)
    # Gemma 3: the sliding-window layers have a rope of their own (base 10k against the global layers' 1M)
    return rotary, rotary if cfg.local_rope_theta is None else RotaryEmbedding(
        rotary_dim, cfg.max_position_embeddings, cfg.local_rope_theta, cfg.local_rope_scaling, device)


def dense_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm over the last dim of x of any shape, in plain torch (the CUDA kernel takes [T, H] only)."""
    return rms_norm_ref(x, norm.weight, norm.eps) if isinstance(norm, RMSNorm) else norm(x)


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] rotated neox-style (halves) over its first rotary_dim channels by cos_sin [L, rotary_dim]."""
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[:, :rot // 2], cos_sin[:, rot // 2:]
    x1, x2 = x[..., :rot].chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


class DecoderForCausalLM(nn.Module):
    # checkpoint module name -> (our merged module name, shard index)
    PACKED_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, quant_config=None):
        super().__init__()
        self.config = cfg
        # a fused checkpoint (Phi-3) names our merged modules itself: each is one shard
        self.packed_modules = {} if cfg.fused_checkpoint else self.PACKED_MODULES
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
        logits = logits.float() if float32 else logits
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits          # Gemma 2

    def source_prefix(self, module_name: str, shard: int) -> str:
        """The checkpoint module that fills shard `shard` of our module (model.layers.0.self_attn.qkv_proj, 1 ->
        model.layers.0.self_attn.k_proj)."""
        parent, _, leaf = module_name.rpartition(".")
        for source, (merged, index) in self.packed_modules.items():
            if merged == leaf and index == shard:
                return f"{parent}.{source}"
        return module_name

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]


def _quantized_head(quant_config) -> bool:
    """A tied model whose checkpoint still carries a quantized lm_head (quantizers untie the head they quantize)."""
    names = getattr(quant_config, "tensor_names", None)
    return names is not None and f"lm_head.{quant_config.marker}" in names
