"""The engine's decoder as the model AWQ and GPTQ calibrate on (quant/block.py's CalibModel / CalibBlock).

Each block is a DecoderLayer of engine/models/decoder.py built in FP32 with dense linears, run through its non-paged
dense_* methods: the model served is the model calibrated, for every architecture the engine loads. The quantizers
hold the block's weights as a dict of checkpoint names (which they fold scales into and swap quantized candidates
in); before each stage the layer's parameters are pointed at the dict's current tensors (q/k/v and gate/up
concatenated into the layer's merged modules, re-done only for tensors that changed).
"""
from typing import Callable

import torch
from torch import nn

from quant_serve.engine.config import ModelConfig
from quant_serve.engine.models.decoder import DecoderForCausalLM, DecoderLayer, dense_norm, make_rotaries
from quant_serve.engine.models.layers import make_norm

# our merged module -> the checkpoint modules that fill it, in shard order
MERGED_SOURCES = {merged: [src for src, (m, _) in sorted(DecoderForCausalLM.PACKED_MODULES.items(),
                                                          key=lambda kv: kv[1][1]) if m == merged]
                  for merged, _ in DecoderForCausalLM.PACKED_MODULES.values()}


class DenseBlock:
    """One decoder block as quant/block.py's CalibBlock: stages on checkpoint-named fp32 weight dicts."""

    def __init__(self, cfg: ModelConfig, index: int, cos_sin: torch.Tensor):
        self.index = index
        # built without memory: every parameter is replaced by w's tensors (bind) before it is used
        self.layer = DecoderLayer(cfg, index, torch.float32, "meta", None)
        self.cos_sin = cos_sin                                           # [L, rotary_dim]
        self.gemma_norm = cfg.gemma_norm
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        if cfg.fused_checkpoint:          # Phi-3: the checkpoint's modules are our merged ones
            self.qkv, self.gate_up = ["self_attn.qkv_proj"], ["mlp.gate_up_proj"]
            self.v_rows = ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv))
            self.up_rows = ("mlp.gate_up_proj", slice(inter, 2 * inter))
        else:
            self.qkv, self.gate_up = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [
                "mlp.gate_proj", "mlp.up_proj"]
            self.v_rows, self.up_rows = ("self_attn.v_proj", slice(0, kv)), ("mlp.up_proj", slice(0, inter))
        self.o, self.down = "self_attn.o_proj", "mlp.down_proj"
        self.qkv_norm = "input_layernorm"
        self.gate_up_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        self.sources: dict[str, list[str]] = {}                          # our parameter -> checkpoint tensors
        for name, _ in self.layer.named_parameters():
            module, leaf = name.rsplit(".", 1)
            parent, _, last = module.rpartition(".")
            shards = [last] if cfg.fused_checkpoint else MERGED_SOURCES.get(last, [last])
            self.sources[name] = [f"{parent}.{s}.{leaf}" if parent else f"{s}.{leaf}" for s in shards]
        self.bound: dict[str, list[torch.Tensor]] = {}

    def bind(self, w: dict[str, torch.Tensor]) -> None:
        for name, keys in self.sources.items():
            missing = [k for k in keys if k not in w]
            if missing:
                raise ValueError(f"model.layers.{self.index}: the checkpoint lacks {', '.join(missing)}, which "
                                 "the model config asks for")
            tensors = [w[k] for k in keys]
            if len(tensors) == len(self.bound.get(name, ())) and all(
                    a is b for a, b in zip(tensors, self.bound[name])):
                continue
            module, leaf = name.rsplit(".", 1)
            module = self.layer.get_submodule(module)
            value = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            if value.shape != getattr(module, leaf).shape:
                raise ValueError(f"model.layers.{self.index}: {', '.join(keys)} make shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(getattr(module, leaf).shape)}")
            setattr(module, leaf, nn.Parameter(value, requires_grad=False))
            self.bound[name] = tensors

    def attn_input(self, w, x):
        self.bind(w)
        return self.layer.dense_attn_input(x)

    def attn_core(self, w, a):
        self.bind(w)
        return self.layer.dense_attn_core(a, self.cos_sin)

    def attn_output(self, w, a):
        return self.layer.self_attn.o_proj(self.attn_core(w, a))

    def mlp_input(self, w, x, o):
        self.bind(w)
        return self.layer.dense_mlp_input(x, o)

    def mlp_act(self, w, m):
        self.bind(w)
        return self.layer.mlp.dense_act(m)

    def mlp_output(self, w, m):
        return self.layer.mlp.down_proj(self.mlp_act(w, m))

    def block_output(self, w, h, d):
        self.bind(w)
        return self.layer.dense_block_output(h, d)

    def forward(self, w, x):
        self.bind(w)
        return self.layer.dense_forward(x, self.cos_sin)

    def fold_norm(self, w: dict, name: str, s: torch.Tensor) -> None:
        key = f"{name}.weight"
        w[key] = (1 + w[key]) / s - 1 if self.gemma_norm else w[key] / s     # Gemma's norm scales by 1 + w


class DenseCalibModel:
    """quant/block.py's CalibModel on a checkpoint read tensor by tensor (read: name -> tensor as stored)."""

    def __init__(self, cfg: ModelConfig, read: Callable[[str], torch.Tensor]):
        self.config, self.read, self.num_layers = cfg, read, cfg.num_layers
        self.rotaries: dict[str, tuple] = {}

    def embed(self, ids: torch.Tensor, device) -> torch.Tensor:
        table = self.read("model.embed_tokens.weight")
        if int(ids.max()) >= table.shape[0] or int(ids.min()) < 0:
            raise ValueError(f"calibration token id {int(ids.max())} is outside the model's vocabulary of "
                             f"{table.shape[0]} (does the tokenizer belong to this model?)")
        x = table[ids].to(device, torch.float32)                                              # [S, L, H]
        if self.config.embed_scale is not None:    # Gemma: sqrt(hidden) rounded to the model dtype, as served
            x = x * torch.tensor(self.config.embed_scale, dtype=self.config.torch_dtype).item()
        return x

    def block(self, index: int, seq_len: int, device) -> DenseBlock:
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(f"calibration windows of {seq_len} tokens exceed the model's "
                             f"{self.config.max_position_embeddings} positions; pass a smaller --calib-seq-len")
        key = str(torch.device(device))
        if key not in self.rotaries:
            self.rotaries[key] = make_rotaries(self.config, device)
        rotary = self.rotaries[key][1 if self.config.window(index) else 0]
        return DenseBlock(self.config, index, rotary.cos_sin_cache[:seq_len])

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        norm = make_norm(self.config, self.config.hidden_size, torch.float32, x.device)
        norm.weight.data = self.read("model.norm.weight").to(x.device, torch.float32)
        return dense_norm(norm, x)


@torch.no_grad()
def dense_logits(cfg: ModelConfig, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The whole model, non-paged, on checkpoint-named fp32 weights: ids [B, L] -> logits [B, L, vocab] fp32."""
    model = DenseCalibModel(cfg, weights.__getitem__)
    device = weights["model.embed_tokens.weight"].device
    x = model.embed(ids.to(device), device)
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        block = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        x = model.block(i, ids.shape[1], device).forward(block, x)
    head = weights["model.embed_tokens.weight"] if cfg.tie_word_embeddings else weights["lm_head.weight"]
    logits = torch.nn.functional.linear(model.final_norm(x), head)
    cap = cfg.final_logit_softcap
    return torch.tanh(logits / cap) * cap if cap else logits                      # Gemma 2
