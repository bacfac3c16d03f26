"""Memory plan: weights + activations + CUDA graph reserve + overhead + KV cache, from config.json alone.

Capacity is planned, not discovered: `quant-serve plan` and the server's startup both call `plan_memory`, and the
server refuses to start when `not plan.fits`. Weights are exact when the model dir holds safetensors (header
sizes, no tensor is loaded); otherwise they are computed per tensor from the config and `quantization_config`
using the layouts of docs/formats.md.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from quant_serve.engine.config import HEAD_GROUP_SIZE
from quant_serve.kernels.attention.kv_exact import ring_bytes
from quant_serve.kernels.attention.kv_int import int_kv_exact_tokens, int_kv_format

MiB = 2**20
GiB = 2**30

# Decode batches are captured from max_num_seqs down to 1 in one shared graph pool; what the pool holds is the
# decode activations of the largest batch (tens of MiB for 7B at 256 rows) plus per-graph bookkeeping. vLLM logs
# 0.3-1 GiB for comparable models, so reserve a flat 512 MiB. Speculation's verification graphs (engine/spec/graphs.py)
# share that pool (their activations are a few rows); their fp32 logits buffer lives outside it (plan_memory's
# verify_rows).
CUDA_GRAPH_RESERVE = 512 * MiB
# CUDA context + cuBLAS/Triton workspaces (about 500 MiB on Ampere/Ada/Hopper), plus caching-allocator
# fragmentation. Counted inside gpu_mem as on a real 24 GB card, so a caller passing measured free memory (context
# already taken) is conservative by about 512 MiB.
CUDA_CONTEXT_RESERVE = 512 * MiB
FRAGMENTATION_RESERVE = 256 * MiB
# Sampler per logit: fp32 probs + sorted fp32 values + int64 sorted indices + fp32 cumsum (top-p/top-k path).
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8 + 4

_FLOAT_BYTES = {"float16": 2, "half": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float32": 4, "float": 4, "fp32": 4}
_KV_BYTES = {"fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
_HEADER_FLOATS = {"F16": 2, "BF16": 2, "F32": 4}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a float dtype given as torch.dtype or name; None means fp16 (the serving default)."""
    name = "float16" if dtype is None else str(dtype).removeprefix("torch.")
    if name not in _FLOAT_BYTES:
        raise ValueError(f"unsupported float dtype {dtype!r}; expected one of {', '.join(_FLOAT_BYTES)}")
    return _FLOAT_BYTES[name]


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype) -> int:
    """Bytes per element of a float KV cache (integer caches: kv_head_token_bytes)."""
    if kv_cache_dtype == "auto":
        return dtype_bytes(model_dtype)
    if kv_cache_dtype not in _KV_BYTES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of: auto, {', '.join(_KV_BYTES)}")
    return _KV_BYTES[kv_cache_dtype]


def kv_head_token_bytes(kv_cache_dtype: str, model_dtype, head_dim: int, group: int | None = None,
                        zero_point: bool | None = None) -> int:
    """Bytes of one token's K (or V) for one kv head: an integer cache's codes plus its fp16 group scales (and
    zero points, kernels/attention/kv_int.py), else head_dim elements of the float dtype."""
    fmt = int_kv_format(kv_cache_dtype, head_dim, group, zero_point)
    if fmt is not None:
        return fmt.bytes_per_head_token(head_dim)
    return head_dim * kv_dtype_bytes(kv_cache_dtype, model_dtype)


@dataclass
class MemoryPlan:
    gpu_mem_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int
    weights_bytes: int
    weights_source: str              # "safetensors" (exact header sizes), "config" (computed), "gguf: TYPES" (by type)
    activation_bytes: int
    cuda_graph_bytes: int
    overhead_bytes: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    max_model_len: int
    max_position_embeddings: int
    max_concurrency: float
    max_model_len_fit: int
    fits: bool
    int4_head: bool = False          # --quantize-lm-head: the head counted as its INT4 copy
    embedding_bytes: int = 0         # the input embedding table (a decode step reads a row of it, unless tied)
    tied_embeddings: bool = False    # the head is the embedding table: read whole every step
    draft_weights_bytes: int = 0     # speculative decoding's draft model (included in weights_bytes)
    lora_bytes: int = 0              # --enable-lora: the adapters' device slots (included in weights_bytes)
    draft_kv_cache_bytes: int = 0    # its KV cache: num_blocks blocks beside the target's (not in kv_cache_bytes)
    exact_window_bytes: int = 0      # an integer cache's exact window: (max_num_seqs + 1) x N tokens, model dtype
    kv_exact_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def error_message(self) -> str:
        if self.fits:
            return ""
        need = math.ceil(self.max_model_len / self.block_size) * self.block_size * self.kv_bytes_per_token
        if self.max_model_len_fit == 0:
            reserved = self.weights_bytes + self.activation_bytes + self.cuda_graph_bytes + self.overhead_bytes \
                + self.exact_window_bytes
            return (f"no KV cache fits: weights + activations + reserves need {reserved / GiB:.2f} GiB of "
                    f"{self.usable_bytes / GiB:.2f} GiB usable; largest context that fits: 0 tokens. Use a "
                    f"larger GPU, a higher gpu_memory_utilization, or lower max_num_batched_tokens/max_num_seqs.")
        return (f"max_model_len {self.max_model_len} needs {need / GiB:.2f} GiB of KV cache, but only "
                f"{self.kv_cache_bytes / GiB:.2f} GiB ({self.kv_cache_tokens} tokens) fit; largest context that "
                f"fits: {self.max_model_len_fit} tokens. Set max_model_len <= {self.max_model_len_fit}"
                + ("" if self.kv_cache_dtype.startswith(("fp8", "int")) else ", use kv_cache_dtype fp8 (or int4)")
                + ", or raise gpu_memory_utilization.")


@dataclass
class _Arch:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    mlp_bias: bool
    dtype: object
    max_position: int
    quant: dict | None
    norms_per_layer: int = 2          # Gemma 2/3: 4 (post-attention, pre/post feed-forward)
    qk_norm: bool = False             # Qwen3, Gemma 3: [head_dim] q and k norms per layer
    fused: bool = False               # Phi-3: qkv_proj and gate_up_proj are single modules in the checkpoint
    rope_tables: int = 1              # Gemma 3: a second table for the sliding-window layers
    rotary_dim: int = 0


_GEMMA = ("gemma2", "gemma3", "gemma3_text")


def _arch(cfg: dict) -> _Arch:
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    per_layer_type = "full_attention" in rope      # Gemma 3: its max_position_embeddings is the extended one
    rope_type = "default" if per_layer_type else rope.get("rope_type", rope.get("type", "default"))
    max_position = cfg["max_position_embeddings"]
    # Like vLLM: yarn/linear/dynamic stretch the original window by `factor`; llama3 configs already state the
    # extended max_position_embeddings.
    if rope_type in ("yarn", "linear", "dynamic") and rope.get("factor"):
        max_position = int(rope.get("original_max_position_embeddings", max_position) * rope["factor"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = (rope.get("partial_rotary_factor") if not per_layer_type else None) or \
        cfg.get("partial_rotary_factor") or 1.0
    model_type = cfg.get("model_type")
    return _Arch(
        hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
        heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, vocab=cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        max_position=max_position, quant=cfg.get("quantization_config"),
        norms_per_layer=4 if model_type in _GEMMA else 2, qk_norm=model_type in ("qwen3", "gemma3", "gemma3_text"),
        fused=model_type == "phi3", rope_tables=2 if per_layer_type else 1, rotary_dim=int(head_dim * partial))


def _load_config(src) -> tuple[dict, Path | None]:
    if isinstance(src, dict):
        return src, None
    from quant_serve.engine.load.gguf.loader import gguf_files
    if gguf_files(src) is not None:
        return _gguf_config(src), None
    path = Path(src)
    model_dir = path.parent if path.is_file() else path
    from transformers import AutoConfig  # heavy import, only when reading from disk
    return AutoConfig.from_pretrained(str(model_dir)).to_dict(), model_dir


def _gguf_config(src) -> dict:
    """A GGUF's config as a transformers config dict, with the tensor table under "gguf_tensors"."""
    from quant_serve.engine.load.gguf.loader import gguf_files, gguf_hf_config, open_gguf
    ckpt = open_gguf(gguf_files(src))
    cfg = gguf_hf_config(ckpt).to_dict()
    # GGUF weights run in fp16 (pick_dtype for quantized models); a tied head is the absence of output.weight
    return {**cfg, "dtype": "float16", "tie_word_embeddings": "output.weight" not in ckpt.tensors,
            "gguf_tensors": ckpt.tensors}


def _quant_linear_bytes(k: int, n: int, q: dict, float_b: int, scale_b: int) -> int:
    """Stored bytes of one INT-quantized Linear (K = in, N = out), per docs/formats.md tables."""
    method = q["quant_method"].lower().replace("_", "-")
    if method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit", 4))
        group = q.get("group_size", q.get("q_group_size", 128))
        groups = math.ceil(k / (k if group <= 0 else group))
        size = k * n * bits // 8 + groups * n * bits // 8 + groups * n * scale_b  # qweight, qzeros, scales
        return size + (k * 4 if method == "gptq" else 0)                         # g_idx int32 [K]
    if method == "compressed-tensors":
        w = next(iter(q["config_groups"].values()))["weights"]
        bits, group = w["num_bits"], w.get("group_size") or k
        groups = 1 if w.get("strategy") == "channel" else math.ceil(k / group)
        zero_point = 0 if w.get("symmetric", True) else n * groups * bits // 8
        return n * k * bits // 8 + n * groups * float_b + zero_point + 2 * 8  # packed, scale, zp, weight_shape
    raise ValueError(f"unsupported quant_method {q['quant_method']!r}; expected awq, gptq or compressed-tensors")


def _computed_weights_bytes(a: _Arch, float_b: int, weights_dtype: str) -> int:
    q = a.quant
    # AWQ/GPTQ store fp16 scales; an explicit weights_dtype converts them along with every other float tensor.
    scale_b = 2 if weights_dtype == "auto" else float_b

    def linear(k: int, n: int, bias: bool, quantized: bool) -> int:
        body = _quant_linear_bytes(k, n, q, float_b, scale_b) if quantized else k * n * float_b
        return body + (n * float_b if bias else 0)

    qd, kvd, h, i = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden, a.intermediate
    if a.fused:
        shapes = [(h, qd + 2 * kvd, a.qkv_bias), (qd, h, False), (h, 2 * i, a.mlp_bias), (i, h, a.mlp_bias)]
    else:
        shapes = [(h, qd, a.qkv_bias), (h, kvd, a.qkv_bias), (h, kvd, a.qkv_bias), (qd, h, False),
                  (h, i, a.mlp_bias), (h, i, a.mlp_bias), (i, h, a.mlp_bias)]
    norms = a.norms_per_layer * h + (2 * a.head_dim if a.qk_norm else 0)
    per_layer = sum(linear(k, n, b, q is not None) for k, n, b in shapes) + norms * float_b
    total = a.layers * per_layer + a.vocab * h * float_b + h * float_b  # + embedding, final norm
    if not a.tied:
        total += linear(h, a.vocab, False, _head_quantized(q))
    return total


def _head_quantized(q: dict | None) -> bool:
    """Whether the checkpoint's config quantizes lm_head (GPTQ `lm_head: true`, compressed-tensors not ignoring it)."""
    return q is not None and (bool(q.get("lm_head", False)) if "config_groups" not in q
                              else not any("lm_head" in s for s in q.get("ignore") or []))


def _int4_head_change(a: _Arch, float_b: int) -> int:
    """Bytes --quantize-lm-head adds: the INT4 g128 copy (codes, fp16 scales, packed zeros as loaded) minus the
    float head it replaces (a tied head's embedding table stays for token lookups)."""
    if _head_quantized(a.quant) and not a.tied:
        return 0
    groups = math.ceil(a.hidden / HEAD_GROUP_SIZE)
    int4 = a.hidden * a.vocab // 2 + groups * a.vocab * 2 + groups * a.vocab // 2
    return int4 - (0 if a.tied else a.hidden * a.vocab * float_b)


def _header_weights_bytes(model_dir: Path, weights_dtype: str, tied: bool) -> int | None:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    target = None if weights_dtype == "auto" else dtype_bytes(weights_dtype)
    seen, total = set(), 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            # A tied head is one resident tensor even if the checkpoint stores a copy.
            if name == "__metadata__" or name in seen or (tied and name == "lm_head.weight"):
                continue
            seen.add(name)
            nbytes = info["data_offsets"][1] - info["data_offsets"][0]
            if target is not None and info["dtype"] in _HEADER_FLOATS:
                nbytes = nbytes // _HEADER_FLOATS[info["dtype"]] * target
            total += nbytes
    return total


def _activation_bytes(a: _Arch, act_b: int, tokens: int, max_num_seqs: int) -> int:
    """Peak transient memory of one step; the forward pass and the sampler do not overlap, so take the max.

    forward = T*act_b*(2H + max(qkv + attn_out, 2I + I))      residual + normed input, then the larger of the
              + dequant workspace                             attention or MLP (gate_up out, silu*mul out) phase;
                                                              large prefill chunks dequantize one Linear (fused
                                                              gate_up, K x 2I) to act dtype for cuBLAS
    sampler = T*H*act_b + R*V*(act_b + 4 + 20)                final hidden, head output, fp32 logits, sampler
              with R = min(max_num_seqs, T) logit rows        (one row per scheduled sequence)
    plus the persistent RoPE cos/sin cache, max_position_embeddings x rotary width fp32 each (sized by the model's
    limit, not max_model_len, so that max_model_len_fit is exact: shrinking max_model_len frees no other memory),
    one per rope of the model (Gemma 3: two).
    """
    qd, kvd, h, i = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden, a.intermediate
    dequant = h * 2 * i * act_b if a.quant is not None else 0
    forward = tokens * act_b * (2 * h + max(qd + 2 * kvd + qd, 3 * i)) + dequant
    rows = min(max_num_seqs, tokens)
    sampler = tokens * h * act_b + rows * a.vocab * (act_b + 4 + SAMPLER_BYTES_PER_LOGIT)
    return max(forward, sampler) + 2 * a.rope_tables * a.max_position * a.rotary_dim * 4


def plan_memory(model_dir_or_config: str | Path | dict, gpu_mem_gb: float = 24.0,
                gpu_memory_utilization: float = 0.90, kv_cache_dtype: str = "auto",
                max_model_len: int | None = None, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                block_size: int = 16, enforce_eager: bool = False, weights_dtype: str = "auto",
                int4_head: bool = False, draft_model: str | Path | dict | None = None,
                quantization: str | None = None, verify_rows: int = 0, lora_bytes: int = 0,
                kv_exact_tokens: int | None = None, kv_group_size: int | None = None,
                kv_zero_point: bool | None = None) -> MemoryPlan:
    """int4_head: the engine's --quantize-lm-head (engine/load/loader.py quantize_head). draft_model: a speculative
    decoding draft: its weights, and its KV cache (as many blocks as the target's, in the weights' dtype), share
    the card with the target's. quantization: gguf:MIX plans dummy weights of that GGUF type mix (a GGUF file's
    own types are read from its tensor table). verify_rows: the token rows of the largest verification graph
    (speculation: batch x (k + 1)), whose fp32 logits buffer the graphs keep beside their pool. kv_exact_tokens:
    an integer cache's exact window (None: the dtype's default): its rings. kv_group_size, kv_zero_point: an integer
    cache's grouping when not the default (CacheConfig's fields)."""
    cfg, model_dir = _load_config(model_dir_or_config)
    a = _arch(cfg)
    float_b = dtype_bytes(a.dtype if weights_dtype == "auto" else weights_dtype)
    kv_b = kv_head_token_bytes(kv_cache_dtype, a.dtype if weights_dtype == "auto" else weights_dtype, a.head_dim,
                               kv_group_size, kv_zero_point)
    max_model_len = a.max_position if max_model_len is None else max_model_len
    if not 0 < max_model_len <= a.max_position:
        raise ValueError(f"max_model_len {max_model_len} must be in 1..{a.max_position} (the model's limit)")

    weights, source = None, "config"
    if "gguf_tensors" in cfg or (quantization or "").lower().startswith("gguf:"):
        from quant_serve.engine.load.gguf.plan import describe_mix, file_weight_bytes, mix_weight_bytes
        weights, mix = (file_weight_bytes(cfg["gguf_tensors"], float_b) if "gguf_tensors" in cfg
                        else mix_weight_bytes(cfg, quantization.split(":", 1)[1], float_b))
        source = f"gguf: {describe_mix(mix)}"
    elif model_dir is not None:
        weights = _header_weights_bytes(model_dir, weights_dtype, a.tied)
        source = "safetensors" if weights is not None else "config"
    if weights is None:
        weights = _computed_weights_bytes(a, float_b, weights_dtype)
    if int4_head:
        weights += _int4_head_change(a, float_b)

    draft_weights = draft_kv_per_token = 0
    if draft_model is not None:
        dcfg, ddir = _load_config(draft_model)
        d = _arch(dcfg)
        d_float_b = dtype_bytes(d.dtype if weights_dtype == "auto" else weights_dtype)
        draft_weights = (_header_weights_bytes(ddir, weights_dtype, d.tied) if ddir is not None else None) or \
            _computed_weights_bytes(d, d_float_b, weights_dtype)
        # the draft's activations come and go between the target's: the target's (larger) reserve covers them
        draft_kv_per_token = 2 * d.layers * d.kv_heads * d.head_dim * d_float_b
        weights += draft_weights
    weights += lora_bytes            # --enable-lora: the adapters' device slots (engine/lora/manager.py:slot_bytes)

    exact = int_kv_exact_tokens(kv_cache_dtype, kv_exact_tokens)
    exact_bytes = ring_bytes(max_num_seqs + 1, exact, a.layers, a.kv_heads, a.head_dim, float_b)
    gpu_mem = int(gpu_mem_gb * GiB)
    usable = int(gpu_mem * gpu_memory_utilization)
    activations = _activation_bytes(a, float_b, max_num_batched_tokens, max_num_seqs)
    graphs = 0 if enforce_eager else CUDA_GRAPH_RESERVE + verify_rows * a.vocab * 4
    overhead = CUDA_CONTEXT_RESERVE + FRAGMENTATION_RESERVE
    kv_per_token = 2 * a.layers * a.kv_heads * kv_b
    free = usable - weights - activations - graphs - overhead - exact_bytes
    num_blocks = max(0, free // ((kv_per_token + draft_kv_per_token) * block_size))
    tokens = num_blocks * block_size
    return MemoryPlan(
        gpu_mem_bytes=gpu_mem, gpu_memory_utilization=gpu_memory_utilization, usable_bytes=usable,
        weights_bytes=weights, weights_source=source, activation_bytes=activations, cuda_graph_bytes=graphs,
        overhead_bytes=overhead, kv_cache_dtype=kv_cache_dtype, kv_bytes_per_token=kv_per_token,
        block_size=block_size, num_blocks=num_blocks, kv_cache_tokens=tokens,
        kv_cache_bytes=tokens * kv_per_token, max_model_len=max_model_len, max_position_embeddings=a.max_position,
        max_concurrency=tokens / max_model_len,
        max_model_len_fit=min(tokens, a.max_position // block_size * block_size),
        fits=num_blocks >= math.ceil(max_model_len / block_size), int4_head=int4_head,
        embedding_bytes=a.vocab * a.hidden * float_b, tied_embeddings=a.tied, draft_weights_bytes=draft_weights,
        draft_kv_cache_bytes=tokens * draft_kv_per_token, exact_window_bytes=exact_bytes, kv_exact_tokens=exact,
        lora_bytes=lora_bytes)


def format_plan(plan: MemoryPlan) -> str:
    def row(label: str, nbytes: int, note: str = "") -> str:
        return f"{label:<14}{nbytes / GiB:>9.2f} GiB" + (f"  {note}" if note else "")

    lines = [
        row("GPU memory", plan.gpu_mem_bytes),
        row("usable", plan.usable_bytes, f"(x {plan.gpu_memory_utilization:.2f})"),
        row("weights", plan.weights_bytes, f"({plan.weights_source}{', INT4 lm_head' if plan.int4_head else ''})"),
        row("activations", plan.activation_bytes),
        row("CUDA graphs", plan.cuda_graph_bytes),
        row("overhead", plan.overhead_bytes, "(CUDA context + fragmentation)"),
        row("KV cache", plan.kv_cache_bytes, f"({plan.kv_bytes_per_token:,} B/token, {plan.kv_cache_dtype})"),
        *([row("exact window", plan.exact_window_bytes, f"(last {plan.kv_exact_tokens} tokens of each sequence "
                                                        "unquantized)")]
          if plan.exact_window_bytes else []),
        f"KV cache: {plan.num_blocks:,} blocks = {plan.kv_cache_tokens:,} tokens, max concurrency "
        f"{plan.max_concurrency:.2f} at max_model_len {plan.max_model_len:,}",
        f"largest context that fits: {plan.max_model_len_fit:,} tokens",
    ]
    if plan.lora_bytes:
        lines[3:3] = [row("  of which LoRA", plan.lora_bytes, "(the --max-loras adapter slots)")]
    if plan.draft_weights_bytes:
        lines[3:3] = [row("  of which draft", plan.draft_weights_bytes, "(speculative decoding)")]
        lines.insert(-2, row("draft KV cache", plan.draft_kv_cache_bytes, "(as many blocks as the target's)"))
    if not plan.fits:
        lines.append("DOES NOT FIT: " + plan.error_message())
    return "\n".join(lines)
