"""Compile, for a GPU profile and without that GPU, every kernel the plan picks there, and read what each needs.

`fit_report(profile)` runs in a fresh process (Triton must not be in interpreter mode): Triton's driver is replaced
by one that names the profile's target (sm80 / sm86 / sm89 / sm90), every launch compiles instead of running, and
the kernels' device queries answer from the profile's capability record (kernels/gpu.py). The W4A16 plan is walked
over the Qwen2.5-7B and Llama-3.1-8B layer shapes for M = 1..8192 (one compile per distinct kernel and
configuration, at the smallest M that picks it), then the attention, KV-store and the other decode-step kernels
are launched on fp16 / fp8 e4m3 / fp8 e5m2 caches and the integer caches' (int8, int4 with and without its exact
window), the W8A16 kernels (GGUF int8-code layers), GGUF's
fragment-layout kernels (Q4_K, Q6_K) and the W4A8 plan with int8 activations asked for (kernels/w4a8: the
activation-quantization kernels and the int8 matmul's tiles at M = 1, 16, 64, 256, per group and per token). Each
compiled kernel is reported with its shared memory, registers, spill stack and the Hopper / fp8 instructions its SASS holds (the wheel's cuobjdump).
"""
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # (K, N) per merged layer, hidden / intermediate / heads of the real configs
    "qwen2.5-7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)},
    "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)},
}
HEADS = {"qwen2.5-7b": (28, 4), "llama-3.1-8b": (32, 8)}     # (query heads, kv heads), head_dim 128
M_VALUES = sorted({*range(1, 129), *range(128, 8193, 64), 256, 1024, 4096, 8192})
HOPPER_SASS = ("HGMMA", "UTMALDG", "UTMASTG", "SYNCS.", "USETMAXREG", "ACQBULK")
FP8_CVT_SASS = ("F2FP.F16.E4M3", "F2FP.F16.E5M2", "F2FP.SATFINITE.E4M3", "F2FP.SATFINITE.E5M2", "E4M3.UNPACK",
                "E5M2.UNPACK")


def in_fresh_process(profile: str) -> dict:
    """fit_report(profile) in a new Python (the test process runs Triton's interpreter)."""
    code = f"import json, kernel_fit; print(json.dumps(kernel_fit.fit_report({profile!r})))"
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO / "tests"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    return json.loads(lines[-1])


def _cuobjdump(cubin: bytes) -> tuple[int, int, str]:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-res-usage", "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", sass).groups())
    return regs, stack, sass


class _CompileOnlyDriver:
    """Triton's active driver, as far as JITFunction.run asks it, for a target with no device present."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch        # a cache key per target

    def get_current_stream(self, device=None):
        return 0


def _install(caps, records: list) -> None:
    """Compile-only launches for caps' target; the kernels' device queries answered from caps."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from quant_serve.kernels import gpu
    driver = importlib.import_module("triton.runtime.driver").driver
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", caps.arch[0] * 10 + caps.arch[1], 32)))
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        records.append((self.fn.__name__, kwargs.get("num_warps", 4), kernel))
    JITFunction.run = compile_only
    runtime = gpu.KernelRuntime(caps)
    answers = {"runtime_for": lambda device: runtime, "device_sms": lambda device: caps.sms,
               "pdl_enabled": lambda t: caps.pdl,
               "e4m3_in_software": lambda device: not caps.fp8_cvt,
               "_fp8_cvt": lambda q, dtype: caps.fp8_cvt and dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
               and q.dtype == torch.float16,
               "probed_runtime": lambda device: runtime, "interpreting": lambda: False}
    import quant_serve.kernels.attention.paged  # noqa: F401 - the modules whose globals are answered below
    import quant_serve.kernels.matmul.dispatch  # noqa: F401
    import quant_serve.kernels.matmul.frag.fold  # noqa: F401
    for name, module in list(sys.modules.items()):
        if name.startswith("quant_serve.kernels"):
            for attr, answer in answers.items():
                if hasattr(module, attr):
                    setattr(module, attr, answer)


def _w4a16_cases(caps) -> list[tuple]:
    """(model, layer, M, dtype, layout, plan) at the smallest M of each distinct (layer shape, layout, kernel,
    config): fp16 models (the fragment layout) and bf16 ones (the row layout)."""
    import torch

    from quant_serve.kernels.gpu import KernelOptions
    from quant_serve.kernels.matmul.plan import layout_for, plan_w4a16
    seen, cases = set(), []
    for dtype in (torch.float16, torch.bfloat16):
        for model, shapes in SHAPES.items():
            for layer, (k, n) in shapes.items():
                layout, _ = layout_for(k, n, 128, dtype, caps, KernelOptions())
                for m in M_VALUES:
                    plan = plan_w4a16(m, k, n, caps, KernelOptions(), layout, dtype, layer == "gate_up")
                    key = (k, n, layout, layer == "gate_up", plan.kernel, plan.config)
                    if key not in seen:
                        seen.add(key)
                        cases.append((model, layer, m, dtype, layout, plan))
    return cases


def _frag(k: int, n: int):
    """Fragment-layout weights of the shape [K, N] (values unread: launches only compile)."""
    import torch

    from quant_serve.kernels.matmul.frag.layout import FragWeights
    kp = -(-k // 64) * 64
    return FragWeights(torch.zeros(n // 16, kp // 64 * 128, dtype=torch.int32),
                       torch.ones(k // 128, n, dtype=torch.float16), torch.zeros(k // 128, n // 8, dtype=torch.int32),
                       128, k, n)


def _launch_w4a16(model, layer, m, dtype, layout, plan) -> None:
    import torch

    from quant_serve.kernels.matmul.dispatch import _frag_forward, _rows_forward
    from quant_serve.kernels.matmul.rows.layout import DEFAULT_PACK_K, W4A16Weights
    from quant_serve.kernels.matmul.frag.fold import FoldedNorm, w4a16_normed, w4a16_residual
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    k, n = SHAPES[model][layer]
    if layout == "rows":
        kp = -(-k // DEFAULT_PACK_K) * DEFAULT_PACK_K
        w = W4A16Weights(torch.zeros(kp // 8, n, dtype=torch.int32), torch.ones(k // 128, n, dtype=dtype),
                         torch.zeros(k // 128, n // 8, dtype=torch.int32), 128, k, DEFAULT_PACK_K, None)
        if plan.kernel == "dequant+cublas":
            from quant_serve.kernels.matmul.rows.gemm import w4a16_dequantize
            w4a16_dequantize(w, dtype)
        else:
            _rows_forward(torch.empty(m, k, dtype=dtype), w, None, plan.config, layer == "gate_up")
        return
    fw = _frag(k, n)
    x = torch.empty(m, k, dtype=torch.float16)
    if plan.kernel == "dequant+cublas":
        frag_dequantize(fw)
        return
    _frag_forward(x, fw, None, plan.config, layer == "gate_up")
    if m == 1 and layer in ("o", "down"):          # the batch-1 decode step's folded norms (engine decoder)
        w4a16_residual(x, fw, torch.empty(1, n, dtype=torch.float16))
    if m == 1 and layer in ("qkv", "gate_up"):
        ss = torch.empty(1, -(-k // 64), dtype=torch.float32)
        w4a16_normed(x, fw, FoldedNorm(ss, torch.ones(k, dtype=torch.float16), 1e-6), silu_mul=layer == "gate_up")


def _launch_attention(model, kv_dtype, batch, context) -> None:
    import torch

    from quant_serve.kernels.attention.reference import build_cos_sin_cache
    from quant_serve.kernels.attention.paged import (NewTokens, paged_decode, paged_prefill, rope_store_kv_triton,
                                                     store_kv_triton)
    from quant_serve.kernels.matmul.frag.fold import w4a16_residual
    hq, hkv = HEADS[model]
    blocks = -(-context // 16)
    k_cache = torch.empty(blocks * batch, 16, hkv, 128, dtype=kv_dtype)
    v_cache = torch.empty_like(k_cache)
    tables = torch.arange(blocks * batch, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q, k, v = (torch.empty(batch, h, 128, dtype=torch.float16) for h in (hq, hkv, hkv))
    positions, slots = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
    cos_sin = build_cos_sin_cache(context, 128, base=10000.0)
    scale = torch.ones((), dtype=torch.float32)
    new = NewTokens(k, v, positions, cos_sin, slots)
    out = paged_decode(q, k_cache, v_cache, tables, lens, qsl, 0.088, scale, scale, new=new, merge=False)
    if batch == 1 and not isinstance(out, torch.Tensor):      # o_proj merging the split partials (batch 1)
        hidden = SHAPES[model]["o"][1]
        w4a16_residual(out, _frag(hq * 128, hidden), torch.empty(1, hidden, dtype=torch.float16))
    paged_decode(q, k_cache, v_cache, tables, lens, qsl, 0.088, scale, scale)
    chunk = min(context, 512)
    qp, kp, vp = (torch.empty(chunk, h, 128, dtype=torch.float16) for h in (hq, hkv, hkv))
    paged_prefill(qp, k_cache, v_cache, tables[:1], torch.tensor([chunk], dtype=torch.int32),
                  torch.tensor([0, chunk], dtype=torch.int32), 0.088, scale, scale)
    store_kv_triton(kp, vp, k_cache, v_cache, torch.zeros(chunk, dtype=torch.long), scale, scale)
    rope_store_kv_triton(qp, kp, vp, torch.zeros(chunk, dtype=torch.long), cos_sin, k_cache, v_cache,
                         torch.zeros(chunk, dtype=torch.long), scale, scale)


def _launch_int_kv(model) -> None:
    """The integer KV cache's store and attention (kernels/attention/kv_int_kernels.py) in each default format
    (int8; int4 with its exact window, and without one), decode (batch 64 x 4096, and batch 1, whose context the
    kernel splits) and a 512-token prefill chunk."""
    import torch

    from quant_serve.kernels.attention.kv_exact import ExactRows, ExactWindow, alloc_rings
    from quant_serve.kernels.attention.kv_int import alloc_int_cache, int_kv_exact_tokens, int_kv_format
    from quant_serve.kernels.attention.kv_int_paged import paged_attention_int, store_int_triton
    from quant_serve.kernels.attention.paged import DecodeConfig, decode_splits
    hq, hkv = HEADS[model]
    batch, context, chunk = 64, 4096, 512
    blocks = -(-context // 16)
    tables = torch.arange(blocks * batch, dtype=torch.int32).view(batch, blocks)
    for dtype in ("int8", "int4"):
        fmt = int_kv_format(dtype, 128)
        (k_c, k_s), (v_c, v_s) = (alloc_int_cache(fmt, blocks * batch, 16, hkv, 128, "cpu") for _ in range(2))
        for exact_tokens in sorted({0, int_kv_exact_tokens(dtype)}):
            for rows, q_len in ((batch, 1), (1, 1), (1, chunk)):      # batch 1 splits its context
                q = torch.empty(rows * q_len, hq, 128, dtype=torch.float16)
                k, v = (torch.empty(rows * q_len, hkv, 128, dtype=torch.float16) for _ in range(2))
                lens = torch.full((rows,), context, dtype=torch.int32)
                qsl = torch.arange(rows + 1, dtype=torch.int32) * q_len
                exact = None
                if exact_tokens:
                    idx = torch.zeros(rows, dtype=torch.int32)
                    exact = ExactWindow(k, v, *alloc_rings(batch + 1, exact_tokens, hkv, 128, torch.float16, "cpu"),
                                        ExactRows(idx, idx, idx, torch.zeros(rows * q_len, dtype=torch.long)))
                store_int_triton(k, v, k_c, v_c, torch.zeros(rows * q_len, dtype=torch.long), k_s, v_s)
                splits = decode_splits(rows * hkv, context, torch.device("cuda"), DecodeConfig()) if q_len == 1 else 1
                paged_attention_int(q, k_c, v_c, tables[:rows], lens, qsl, 0.088, k_s, v_s, exact=exact,
                                    num_splits=splits)
        _launch_int_prologue(hq, hkv, fmt, k_c, v_c, k_s, v_s, rotate=dtype == "int4")


def _launch_int_prologue(hq, hkv, fmt, k_c, v_c, k_s, v_s, rotate: bool) -> None:
    """The integer cache's fused RoPE / rotation / store and the rotation back (kernels/attention/kv_int_prologue.py)."""
    import torch

    from quant_serve.kernels.attention.kv_int_prologue import int_prologue_triton, rotate_triton
    tokens = 4
    q = torch.empty(tokens, hq, 128, dtype=torch.float16)
    k, v = (torch.empty(tokens, hkv, 128, dtype=torch.float16) for _ in range(2))
    int_prologue_triton(q, k, v, torch.zeros(tokens, dtype=torch.long), torch.empty(64, 128), rotate, k_c, v_c,
                        torch.zeros(tokens, dtype=torch.long), k_s, v_s)
    if rotate:
        rotate_triton(q)


def _launch_lora(model) -> None:
    """Batched LoRA shrink / expand (kernels/lora/) at rank 16 over 8 slots, decode rows 1 and 32."""
    import torch

    from quant_serve.kernels.lora.triton_kernels import lora_expand_triton, lora_shrink_triton
    hidden, inter = SHAPES[model]["o"][1], SHAPES[model]["down"][0]
    for rows in (1, 32):
        slots = torch.zeros(rows, dtype=torch.int32)
        for k, parts in ((hidden, [SHAPES[model]["qkv"][1]]), (inter, [hidden])):
            h = lora_shrink_triton(torch.empty(rows, k, dtype=torch.float16),
                                   torch.empty(8, 16 * len(parts), k, dtype=torch.float16), slots)
            lora_expand_triton(h, torch.empty(8, sum(parts), 16, dtype=torch.float16), slots,
                               torch.empty(rows, sum(parts), dtype=torch.float16), parts)


def _launch_w8a16() -> None:
    """The W8A16 kernels (GGUF Q8_0 / Q5_* / Q6_K layers) at one shape, groups of 32 with offsets: the FMA GEMV
    (M = 1), the tl.dot GEMV in 16-, 32- and 64-row blocks (M = 8, 32, 64) and the dequantize pass (past
    DOT_MAX_M): tiles do not depend on the layer's shape."""
    import torch

    from quant_serve.kernels.matmul.dispatch import w8a16_forward
    from quant_serve.kernels.matmul.plan import DOT_MAX_M
    k, n = SHAPES["qwen2.5-7b"]["qkv"]
    codes = torch.empty(k, n, dtype=torch.int8)
    scales = torch.empty(k // 32, n, dtype=torch.float16)
    for m in (1, 8, 32, 64, DOT_MAX_M + 1):
        w8a16_forward(torch.empty(m, k, dtype=torch.float16), codes, scales, scales, 32)


def _launch_gguf_frag() -> None:
    """GGUF's fragment-layout kernels (Q4_K's two-level scales, Q6_K's 6-bit codes, Q5_K's 5-bit codes) at the down
    shape: M = 1 and M = 16 through the planned mma kernel, and the dequantize pass."""
    import torch

    from quant_serve.kernels.matmul.dispatch import call_plan, _frag_forward
    from quant_serve.kernels.matmul.frag.layout import FragWeights
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    k, n = SHAPES["qwen2.5-7b"]["down"]
    q4k = FragWeights(torch.zeros(n // 16, k // 64 * 128, dtype=torch.int32),
                      torch.zeros(k // 32, n, dtype=torch.int16), None, 32, k, n,
                      superscales=torch.zeros(k // 256, n, dtype=torch.int32))
    q6 = FragWeights(torch.zeros(n // 16, k // 64 * 128, dtype=torch.int32), torch.ones(k // 16, n, dtype=torch.float16),
                     None, 16, k, n, hi=torch.zeros(n // 16, k // 64 * 64, dtype=torch.int32))
    q5 = FragWeights(torch.zeros(n // 16, k // 64 * 128, dtype=torch.int32), torch.zeros(k // 32, n, dtype=torch.int32),
                     None, 32, k, n, hi=torch.zeros(n // 16, k // 64 * 32, dtype=torch.int32))
    for fw in (q4k, q6, q5):
        for m in (1, 16):
            x = torch.empty(m, k, dtype=torch.float16)
            _frag_forward(x, fw, None, call_plan(x, fw).config, False)
        frag_dequantize(fw)


def _launch_w4a8(caps) -> None:
    """The W4A8 path as activation_dtype="int8" plans it on this target (the tiles do not depend on the model beyond
    K and N): every layer of both models at M = 1, 16, 64, 256, per-group scales, and per-token scales once."""
    import dataclasses

    import torch

    from quant_serve.kernels.gpu import KernelOptions
    from quant_serve.kernels.matmul.dispatch import _frag_forward
    from quant_serve.kernels.matmul.plan import plan_w4a16
    seen = set()
    for shapes in SHAPES.values():
        for k, n in shapes.values():
            for m in (1, 16, 64, 256):
                for act_scale in ("group", "token") if m == 256 else ("group",):
                    plan = plan_w4a16(m, k, n, caps, KernelOptions(activation_dtype="int8", act_scale=act_scale))
                    cfg = dataclasses.replace(plan.config, split_k=min(plan.config.split_k, 2))
                    if plan.kernel == "w4a8" and (cfg, k % 128, n % cfg.block_n) not in seen:
                        seen.add((cfg, k % 128, n % cfg.block_n))
                        _frag_forward(torch.empty(m, k, dtype=torch.float16), _frag(k, n), None, cfg, False)


def _launch_step_kernels(model) -> None:
    import torch

    from quant_serve.kernels.argmax import argmax_rows_triton
    from quant_serve.kernels.gemv import gemv
    from quant_serve.kernels.norm_act import rms_norm_triton, silu_and_mul_triton
    from quant_serve.kernels.step_inputs import take_carried_triton
    hidden, inter = SHAPES[model]["o"][1], SHAPES[model]["down"][0]
    vocab = 152064 if model.startswith("qwen") else 128256
    for tokens in (1, 256):
        x = torch.empty(tokens, hidden, dtype=torch.float16)
        rms_norm_triton(x, torch.ones(hidden, dtype=torch.float16), 1e-6, x)
        silu_and_mul_triton(torch.empty(tokens, 2 * inter, dtype=torch.float16))
    gemv(torch.empty(1, hidden, dtype=torch.float16), torch.empty(vocab, hidden, dtype=torch.float16))
    argmax_rows_triton(torch.empty(8, vocab, dtype=torch.float32))
    take_carried_triton(torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long),
                        torch.zeros(8, dtype=torch.long))


def fit_report(profile: str) -> dict:
    import torch

    from quant_serve.kernels.gpu import PROFILES
    caps = PROFILES[profile]
    records: list = []
    _install(caps, records)
    cases = _w4a16_cases(caps)
    launched = []
    for model, layer, m, dtype, layout, plan in cases:
        _launch_w4a16(model, layer, m, dtype, layout, plan)
        launched.append({"model": model, "layer": layer, "m": m, "dtype": str(dtype).removeprefix("torch."),
                         "layout": layout, "kernel": plan.kernel,
                         "config": None if plan.config is None else repr(plan.config)})
    for model in SHAPES:
        for kv in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
            for batch, context in ((1, 512), (1, 4096), (64, 4096)):
                _launch_attention(model, kv, batch, context)
        _launch_step_kernels(model)
        _launch_int_kv(model)
        _launch_lora(model)
    _launch_w8a16()
    _launch_gguf_frag()
    _launch_w4a8(caps)
    kernels, seen = [], set()
    for name, warps, compiled in records:
        if compiled is None or id(compiled) in seen:
            continue
        seen.add(id(compiled))
        regs, stack, sass = _cuobjdump(compiled.asm["cubin"])
        kernels.append({"name": name, "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                        "regs": regs, "stack": stack,
                        "hopper_sass": sorted({op for op in HOPPER_SASS if op in sass}),
                        "fp8_cvt_sass": sorted({op for op in FP8_CVT_SASS if op in sass})})
    return {"profile": profile, "arch": list(caps.arch), "smem_per_block": caps.smem_per_block,
            "w4a16_plans": launched, "kernels": kernels}
