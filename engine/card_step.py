"""The kernels of a decode step and of a prefill chunk, as the card model (engine/card_model.py) times them.

A model is its per-layer matmuls with the bytes its weight format stores (`model_shape`: AWQ / GPTQ / compressed-
tensors INT4 from engine/memory.py's per-tensor sizes, FP16, or a GGUF type mix from engine/gguf_plan.py's per-layer
sizes), and a step is the list of its launches (`decode_kernels`, `prefill_kernels`). Which kernel a matmul runs is
the plan's own answer for the card (kernels/w4a16/plan.py, kernels/w8a16/plan.py): a fused INT4 kernel (one launch;
tensor-core operations 2 x M x K x N with M rounded up to the 16-row MMA tile) or dequantize + cuBLAS (two launches:
the dequantize pass reads the codes and writes an FP16 copy that cuBLAS reads again). The launches per layer follow
the profiles of the engine's steps (bench/results/profile-decode-b1-h200.json, profile-decode-h200.json): batch 1 on
the folded path is qkv, attention, o, gate_up (SwiGLU in its reduce), down; other steps add two RMSNorms and the
RoPE / KV store, and a SwiGLU launch where gate_up is dequantize + cuBLAS. Nothing here imports Triton or needs a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from quant_serve.kernels.gpu import GPUCaps, KernelOptions
from quant_serve.kernels.w4a16.frag import ZP_INT4, ZP_OFFSETS, ZP_Q5, ZP_Q6
from quant_serve.kernels.w4a16.plan import plan_w4a16
from quant_serve.kernels.w8a16.plan import plan_w8a16

# Rows of x one tile of our kernels multiplies: mma.sync m16n8k16 takes x^T as its B operand (kernels/w4a16/mma.py:
# y^T = W^T x^T), so M = 1..8 costs one n8 tile; Hopper's TMA / wgmma kernels 64-row tiles (kernels/w4a16/rules.py
# TMAConfig.block_m). W8A16's GEMV at M = 1 runs FMAs, no tensor cores.
TILE_ROWS = {"mma": 8, "wgmma": 64}
TILE_OF = {"mma.sync": "mma", "gemv-dot": "mma", "wgmma": "wgmma", "tma": "wgmma", "gemv": ""}


@dataclass(frozen=True)
class Kernel:
    """One launch as the card model sees it. family: whose bytes per SM-clock bound it ("fp16" cuBLAS, "int4"
    AWQ / GPTQ, "dequant", "attn_fp16" / "attn_fp8", "small", "gguf_q4_k", ...); tile: whose tensor operations per
    SM-clock bound it ("mma": mma.sync, "wgmma": Hopper's warpgroup tiles; "": cuBLAS or no tensor cores);
    grid_sized: its grid follows the plan's SM count (a profile's on an emulating GPU) rather than the hardware's."""
    name: str
    family: str
    nbytes: float                  # DRAM bytes read and written
    ops: float = 0.0               # tensor-core operations
    dtype: str = ""                # tensor dtype of `ops`: fp16_f32acc | fp16 | int8 | fp8
    tile: str = ""
    grid_sized: bool = False


@dataclass(frozen=True)
class Matmul:
    """One weight matrix of a layer (or one part of a merged layer): x [M, K] @ W [K, N]."""
    name: str
    k: int
    n: int
    nbytes: int                    # stored bytes: codes + scales + zeros / offsets, bias
    family: str                    # "fp16", "int4", "gguf_q4_k", "gguf_q6_k", ...


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: tuple[tuple[Matmul, ...], ...]     # per layer: its matmuls (qkv parts, o, gate_up parts, down)
    head: Matmul
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    kv_bytes_per_token: int                   # all layers, K and V
    kv_dtype_bytes: int                       # 2 (fp16 / bf16) or 1 (fp8)
    folds: bool                               # batch 1 runs the folded path (engine/models/fused_decode.py)

    @property
    def step_weight_bytes(self) -> int:
        return sum(m.nbytes for layer in self.layers for m in layer) + self.head.nbytes


_ZP_MODES = {"int4": ZP_INT4, "gguf_q4_0": ZP_OFFSETS, "gguf_q4_k": ZP_OFFSETS, "gguf_q5_k": ZP_Q5,
             "gguf_q6_k": ZP_Q6}


def _gguf_family(qtype) -> str:
    from gguf import GGMLQuantizationType as T
    from quant_serve.quant.formats.gguf_types import path_of
    if path_of(qtype) == "dense":
        return "fp16"
    return {T.Q4_0: "gguf_q4_0", T.Q4_1: "gguf_q4_0", T.Q4_K: "gguf_q4_k", T.Q5_K: "gguf_q5_k",
            T.Q6_K: "gguf_q6_k"}.get(qtype, "gguf_q8_0")        # Q8_0 / Q5_0 / Q5_1: the W8A16 int8 kernels


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _file_type_of(tensors: dict):
    """A GGUF file's tensor table -> type_of(module prefix), as gguf_config's dummy mixes answer it."""
    def type_of(prefix: str):
        if prefix == "lm_head":
            return (tensors.get("output.weight") or tensors["token_embd.weight"]).tensor_type
        layer, module = prefix.removeprefix("model.layers.").split(".", 1)
        return tensors[f"blk.{layer}.{_GGUF_NAMES[module]}.weight"].tensor_type
    return type_of


def model_shape(cfg: dict, quantization: str | None = None, kv_bytes: int = 2, int4_head: bool = False,
                name: str = "") -> ModelShape:
    """A transformers config dict (its quantization_config: INT4; none: FP16; a GGUF file's, engine/memory.py's
    _load_config, with its tensor table) or quantization "gguf:MIX" (a dummy mix)."""
    from quant_serve.engine.memory import _arch, _quant_linear_bytes
    a = _arch(cfg)
    h, i, qd, kvd = a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim
    groups = [("qkv", h, [qd, kvd, kvd], a.qkv_bias), ("o", qd, [h], False), ("gate_up", h, [i, i], a.mlp_bias),
              ("down", i, [h], a.mlp_bias)]
    gguf = "gguf_tensors" in cfg or (quantization or "").lower().startswith("gguf:")
    if gguf:
        from quant_serve.engine.gguf_plan import _layer_bytes
        from quant_serve.quant.formats.gguf_config import dummy_gguf_config
        type_of = _file_type_of(cfg["gguf_tensors"]) if "gguf_tensors" in cfg else \
            dummy_gguf_config(quantization.split(":", 1)[1], a.layers).type_of
        names = {"qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o": ["self_attn.o_proj"],
                 "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}

    def gguf_parts(label, k, ns, types, bias):
        """Runs of one family are one launch each (quant/linear_parts.py); a mix of INT4 types with the W8 types
        loads as one W8 layer (engine/gguf_plan.py)."""
        fams = [_gguf_family(t) for t in types]
        if "gguf_q8_0" in fams and len(set(fams)) > 1:
            fams = ["gguf_q8_0"] * len(fams)
        runs = []
        for f, t, n in zip(fams, types, ns):
            if runs and runs[-1][0] == f:
                runs[-1][1].append((t, k, n))
            else:
                runs.append((f, [(t, k, n)]))
        return [Matmul(label if len(runs) == 1 else f"{label}.{j}", k, sum(s[2] for s in shards),
                       _layer_bytes(shards, 2) + (sum(s[2] for s in shards) * 2 if bias else 0), f)
                for j, (f, shards) in enumerate(runs)]

    layers = []
    for layer in range(a.layers):
        mms = []
        for label, k, ns, bias in groups:
            if gguf:
                types = [type_of(f"model.layers.{layer}.{n}") for n in names[label]]
                mms += gguf_parts(label, k, ns, types, bias)
            elif a.quant is not None:
                mms.append(Matmul(label, k, sum(ns), sum(_quant_linear_bytes(k, n, a.quant, 2, 2) for n in ns)
                                  + (sum(ns) * 2 if bias else 0), "int4"))
            else:
                mms.append(Matmul(label, k, sum(ns), k * sum(ns) * 2 + (sum(ns) * 2 if bias else 0), "fp16"))
        layers.append(tuple(mms))
    if gguf and not a.tied:       # a tied head is the embedding table, which loads in the model dtype
        head = gguf_parts("head", h, [a.vocab], [type_of("lm_head")], False)[0]
    elif int4_head:
        head = Matmul("head", h, a.vocab, a.vocab * h // 2 + (h // 128) * a.vocab * 5 // 2, "int4")
    else:
        head = Matmul("head", h, a.vocab, h * a.vocab * 2, "fp16")
    folds = (cfg.get("model_type") in ("llama", "qwen2", "mistral") and all(
        len(layer) == 4 and layer[0].family in ("int4", "gguf_q4_0", "gguf_q4_k") and
        len({m.family for m in layer}) == 1 for layer in layers))
    return ModelShape(name or cfg.get("model_type", "model"), tuple(layers), head, h, i, a.heads, a.kv_heads,
                      a.head_dim, a.vocab, 2 * a.layers * kvd * kv_bytes, kv_bytes, folds)


def matmul_kernels(mm: Matmul, m: int, caps: GPUCaps) -> list[Kernel]:
    """The launches of x [m, K] @ W under `caps`' plan."""
    if mm.family == "fp16":
        kernel = "cublas"
    elif mm.family == "gguf_q8_0":
        kernel = plan_w8a16(m, mm.k, mm.n, 32, caps.sms).kernel
    else:
        kernel = plan_w4a16(m, mm.k, mm.n, caps, KernelOptions(), "frag", zp_mode=_ZP_MODES[mm.family]).kernel
    return launches(mm, m, kernel)


def launches(mm: Matmul, m: int, kernel: str) -> list[Kernel]:
    """The launches of x [m, K] @ W when the plan picked `kernel` ("cublas" for FP16 weights)."""
    act = m * mm.k * 2 + m * mm.n * 2
    cublas = Kernel(f"{mm.name}.cublas", "fp16", mm.k * mm.n * 2 + act, 2.0 * m * mm.k * mm.n, "fp16_f32acc")
    if kernel == "cublas":
        return [cublas]
    if kernel == "dequant+cublas":
        return [Kernel(f"{mm.name}.dequant", "dequant", mm.nbytes + mm.k * mm.n * 2), cublas]
    tile = TILE_OF[kernel]
    if not tile:
        return [Kernel(mm.name, mm.family, mm.nbytes + act, grid_sized=True)]
    rows = -(-m // TILE_ROWS[tile]) * TILE_ROWS[tile]
    return [Kernel(mm.name, mm.family, mm.nbytes + act, 2.0 * rows * mm.k * mm.n, "fp16_f32acc", tile, True)]


def attention_family(kv_dtype_bytes: int) -> str:
    """fp8 KV is converted on load (in software without sm89's cvt): its own bytes per SM-clock."""
    return "attn_fp8" if kv_dtype_bytes == 1 else "attn_fp16"


def _small(name: str, nbytes: float) -> Kernel:
    return Kernel(name, "small", nbytes)


def _layer_kernels(shape: ModelShape, layer: tuple[Matmul, ...], m: int, caps: GPUCaps, attn: Kernel,
                   folded: bool) -> list[Kernel]:
    h, qkv_width = shape.hidden, (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    qkv = [x.name for x in layer if x.name.startswith("qkv")]
    gate_up = [x.name for x in layer if x.name.startswith("gate_up")]
    out = []
    for mm in layer:
        launches = matmul_kernels(mm, m, caps)
        if not folded and mm.name in ("qkv", "qkv.0", "gate_up", "gate_up.0"):
            out.append(_small("norm", 4 * m * h * 2))                       # residual add + RMSNorm
        out += launches
        if mm.name == gate_up[-1] and (len(launches) > 1 or len(gate_up) > 1):
            out.append(_small("silu_mul", 3 * m * shape.intermediate * 2))    # not fused: dequant path or parts
        if mm.name == qkv[-1]:
            if not folded:
                out.append(_small("rope_kv", 2 * m * qkv_width * 2))
            out.append(attn)
    return out


def decode_kernels(shape: ModelShape, caps: GPUCaps, batch: int, context: int) -> list[Kernel]:
    """One decode step of `batch` sequences of `context` tokens each."""
    folded = batch == 1 and shape.folds
    kv_layer = shape.kv_bytes_per_token // len(shape.layers)
    attn = Kernel("attn", attention_family(shape.kv_dtype_bytes),
                  batch * context * kv_layer + 4 * batch * shape.heads * shape.head_dim, grid_sized=True)
    out = [_small("embed", 2 * batch * shape.hidden * 2)]
    for layer in shape.layers:
        out += _layer_kernels(shape, layer, batch, caps, attn, folded)
    out += [_small("norm", 3 * batch * shape.hidden * 2), *matmul_kernels(shape.head, batch, caps),
            _small("sample", batch * shape.vocab * 6)]
    return out


def prefill_kernels(shape: ModelShape, caps: GPUCaps, tokens: int, prior: int = 0) -> list[Kernel]:
    """One prefill chunk of `tokens` tokens of one sequence after `prior` tokens already in its cache; the head runs
    for the last token only."""
    kv_layer = shape.kv_bytes_per_token // len(shape.layers)
    width = shape.heads * shape.head_dim
    attn = Kernel("attn_prefill", attention_family(shape.kv_dtype_bytes),
                  (prior + tokens) * kv_layer + 4 * tokens * width,
                  4.0 * width * tokens * (prior + (tokens + 1) / 2), "fp16_f32acc", "mma", True)
    out = [_small("embed", 2 * tokens * shape.hidden * 2)]
    for layer in shape.layers:
        out += _layer_kernels(shape, layer, tokens, caps, attn, False)
    out += [_small("norm", 3 * shape.hidden * 2), *matmul_kernels(shape.head, 1, caps),
            _small("sample", shape.vocab * 6)]
    return out
