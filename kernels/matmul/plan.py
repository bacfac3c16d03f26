"""Which matmul kernel runs for a quantized layer, with which configuration, and why: pure functions of the
shape, the GPU's capability record and the engine's kernel options. `plan_w4a16` for INT4 weights (fragment or row
layout, fp16 or int8 activations; `layout_for` picks the layout at load) and `plan_w8a16` for 8-bit codes and
the GGUF code planes. The forward pass (dispatch.py), `quant-serve kernels --explain`, the benchmarks and the
offline fit test all ask here, so what they report is what runs; the measurements behind each rule are in
docs/kernels.md. On a real device the caps are first narrowed by probes (probes.py).
"""
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from quant_serve.kernels.gpu import GPUCaps, KernelOptions
from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_OFFSETS, ZP_Q5, ZP_Q6
from quant_serve.kernels.matmul.int8.rules import W4A8Config, plan_w4a8
from quant_serve.kernels.matmul.rules import (MMA_MAX_M, TMA_MAX_M, TMA_MIN_M, WGMMA_MAX_M, MMAConfig, TMAConfig,
                                              W4A16Config, measured_on, select_config, select_mma_config,
                                              select_tma_config)


@dataclass(frozen=True)
class KernelPlan:
    """kernel: "mma.sync" | "wgmma" | "tma" (fragment layout), "w4a8" (fragment layout, x quantized to int8:
    kernels/w4a8), "gemv" | "gemm" | "gemmt" (row layout), "dequant+cublas" (either layout) or "torch" (the CPU
    twin); config: that kernel's tile; why: one line."""
    kernel: str
    config: MMAConfig | TMAConfig | W4A16Config | W4A8Config | None
    why: str


def layout_for(k: int, n: int, group_size: int, scales_dtype: torch.dtype, caps: GPUCaps,
               options: KernelOptions, offsets: bool = False, frag_offsets: bool = True) -> tuple[str, str]:
    """-> ("frag" | "rows", why): the layout a layer's weights are prepared in at load. offsets: the layer has
    float per-group offsets (GGUF Q4_0 / Q4_1 / Q4_K, W = q * s + o), which every kernel of both layouts takes
    (ZP_MODE / OFFSETS constexprs). frag_offsets False: the device's offset probe of the fragment kernels failed
    (`frag_offsets_work`), so an offset layer goes to the row layout."""
    gs = k if group_size <= 0 else group_size
    if offsets and not frag_offsets:
        return "rows", "float offsets (GGUF): the fragment kernels' offset probe failed on this device"
    if not caps.tensor_cores:
        return "rows", f"{caps.family} has no mma.sync tensor cores (sm80+)"
    if not options.frag_layout:
        return "rows", "the fragment layout is turned off (KernelOptions.frag_layout)"
    if scales_dtype != torch.float16:
        return "rows", f"{str(scales_dtype).removeprefix('torch.')} scales: the fragment kernels are fp16"
    if n % 16:
        return "rows", f"N = {n} is not a multiple of 16"
    if gs < k and gs % 16:
        return "rows", f"group size {gs} is not a multiple of 16"
    return "frag", "fp16, N % 16 == 0: tensor-core kernels from M = 1"


@lru_cache(maxsize=4096)
def plan_w4a16(m: int, k: int, n: int, caps: GPUCaps, options: KernelOptions = KernelOptions(),
               layout: str = "frag", dtype: torch.dtype = torch.float16, silu_mul: bool = False,
               tma_fits: bool = True, zp_mode: int = ZP_INT4, group_size: int = 128) -> KernelPlan:
    """The kernel for x [M, K] @ W [K, N] (INT4) on a GPU with `caps`, the weights in `layout`. silu_mul: the call
    also applies SwiGLU to the output (gate | up). tma_fits: the call's x suits TMA (16-byte aligned rows). zp_mode:
    the fragment weights' (frag.py; float offsets and Q6_K take no register cap: their M = 1 loop needs 72 and 102
    registers, and capped at 56 spills 88 and 176 bytes, offline sm90; gate_up with offsets 35.6 us uncapped
    against 47.4 capped, bench/results/kernels-gguf-q4k-h100.json). group_size (-1 or K: one group) and
    options.activation_dtype / act_scale decide whether x is quantized to int8 for the W4A8 kernel (w4a8.rules)."""
    if layout == "rows":
        return _plan_rows(m, k, n, caps)
    if dtype != torch.float16:
        return KernelPlan("dequant+cublas", None, f"{str(dtype).removeprefix('torch.')} activations: the "
                                                  "fragment kernels take fp16")
    a8, why = plan_w4a8(m, k, n, caps, options, zp_mode, group_size)
    if a8 is not None:
        return KernelPlan("w4a8", a8, why)
    plan = _plan_frag(m, k, n, caps, options, silu_mul, tma_fits, zp_mode)
    return replace(plan, why=f"{plan.why}; {why}") if why else plan


def _plan_frag(m: int, k: int, n: int, caps: GPUCaps, options: KernelOptions, silu_mul: bool, tma_fits: bool,
               zp_mode: int) -> KernelPlan:
    """The fp16-activation kernels of the fragment layout."""
    why_not_tma = ""
    if TMA_MIN_M <= m <= TMA_MAX_M:
        if caps.tma and options.tma and tma_fits and zp_mode not in _HIGH_BITS:
            tc = select_tma_config(m, k, n, caps.sms)
            if tc is not None:
                return KernelPlan("tma", tc, f"M = {TMA_MIN_M}..{TMA_MAX_M} on {caps.family}: TMA-fed wgmma, "
                                             f"stream-K over {caps.sms} SMs (rules.select_tma_config, {_where(caps)})")
        why_not_tma = " (no TMA)" if not caps.tma else " (TMA off)" if not options.tma else \
            " (the TMA kernel does not read Q6_K / Q5_K's high-bit words)" if zp_mode in _HIGH_BITS else \
            " (x rows not 16-byte aligned for TMA)" if not tma_fits else ""
    cfg = mma_config(m, k, n, zp_mode, caps.wgmma, silu_mul, caps.sms)
    if cfg is None:
        top = WGMMA_MAX_M if caps.wgmma else MMA_MAX_M
        return KernelPlan("dequant+cublas", None, f"M = {m} > {top}{why_not_tma}: dequantize the fragment layout "
                                                  "once, then cuBLAS")
    uncapped = ""
    if zp_mode in _UNCAPPED and select_mma_config(m, k, n, caps.wgmma, silu_mul, caps.sms).max_regs:
        uncapped = ", no register cap (its dequant needs more than the cap)"
    kind = "wgmma" if cfg.wgmma else "mma.sync"
    band = "M = 17.." + str(WGMMA_MAX_M) if cfg.wgmma else f"M <= {MMA_MAX_M}"
    return KernelPlan(kind, cfg, f"{band}{why_not_tma}: {kind} over the fragment layout, {cfg.split_k} K "
                                 f"split(s) for {caps.sms} SMs{uncapped} (rules.select_mma_config, {_where(caps)})")


_UNCAPPED = (ZP_OFFSETS, ZP_Q6, ZP_Q5)
_HIGH_BITS = (ZP_Q6, ZP_Q5)         # words with a high-bit tensor beside them (frag6.py, frag5.py)


def mma_config(m: int, k: int, n: int, zp_mode: int = ZP_INT4, wgmma: bool = False, silu_mul: bool = False,
               sms: int = 132) -> MMAConfig | None:
    """rules.select_mma_config's tile for weights of `zp_mode`, without its register cap for float offsets, Q6_K
    and Q5_K (their M = 1 loop needs 72, 102 and 72 registers; capped at 56 gate_up spills 88, 176 and 80 bytes,
    offline sm90)."""
    cfg = select_mma_config(m, k, n, wgmma, silu_mul, sms)
    return replace(cfg, max_regs=0) if cfg is not None and cfg.max_regs and zp_mode in _UNCAPPED else cfg


def _plan_rows(m: int, k: int, n: int, caps: GPUCaps) -> KernelPlan:
    cfg = select_config(m, k, n, caps.family, caps.sms)
    kernel = "dequant+cublas" if cfg.path == "dequant" else cfg.path
    return KernelPlan(kernel, None if cfg.path == "dequant" else cfg,
                      f"row layout, M = {m}: {cfg.path} (rules.select_config, {_where(caps)})")


def _where(caps: GPUCaps) -> str:
    measured = measured_on(caps.family)
    return f"measured on {measured.split(' (')[0]}" if measured else f"derived for {caps.family}, not measured"


# ---- 8-bit codes and GGUF code planes (W8A16) ------------------------------------------------------------------

GEMV_MAX_M = 16        # code planes: split-K GEMV up to here (decode, memory-bound); dequantize + cuBLAS above
DOT_MAX_M = 256        # int8 codes: the GEMV's tl.dot row blocks up to here; dequantize + cuBLAS above
FMA_MAX_M = 1          # one row a program with CUDA-core FMAs; more rows share each weight tile through tl.dot
_PROGRAMS_PER_SM = 10  # int8 codes: split K until tiles x splits reach about this many programs an SM
MAX_SPLIT = 16
_PLANES_PROGRAMS_PER_SM = 10   # the code-plane layouts: more loads in flight (measured, see above)
_PLANES_MAX_SPLIT = 32


@dataclass(frozen=True)
class W8A16Config:
    path: str                 # "gemv" | "dequant"
    block_m: int = 1          # gemv: 1 = one x row a program (FMA), 16 = up to 16 rows a program (tl.dot)
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1          # upper bound: the launcher never leaves a split empty
    num_warps: int = 4
    one_launch: bool = False  # split-K partials summed by the last split (splitk.py) instead of a second kernel


@dataclass(frozen=True)
class W8A16Plan:
    """kernel: "gemv" | "gemv-dot" | "dequant+cublas" | "torch" (the CPU twin); config: its tile; why: one line."""
    kernel: str
    config: W8A16Config | None
    why: str


@lru_cache(maxsize=4096)
def plan_w8a16(m: int, k: int, n: int, group_size: int, sms: int = 132, layout: str = "int8") -> W8A16Plan:
    """The kernel for x [M, K] @ W [K, N] on a GPU with `sms` SMs; layout "int8" (codes in groups of group_size),
    "q6k" or "q5k" (the code planes of q6k.py / q5k.py)."""
    if layout not in ("int8", "q6k", "q5k"):
        raise ValueError(f"unknown W8A16 layout {layout!r}: int8, q6k or q5k")
    if layout != "int8":
        return _dequant_plan(m, GEMV_MAX_M) if m > GEMV_MAX_M else _plan_planes(m, k, n, sms, layout)
    if m > DOT_MAX_M:
        return _dequant_plan(m, DOT_MAX_M)
    block_m = 1 if m <= FMA_MAX_M else 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 32
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // block_k)
    split = 1
    while split < MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * sms and steps >= split * 4:
        split *= 2
    cfg = W8A16Config("gemv", block_m, block_n, block_k, split, 4)
    if block_m == 1:
        return W8A16Plan("gemv", cfg, f"M = {m}: split-K GEMV, one row a program, CUDA-core FMAs, {split} K "
                                      f"split(s) for {sms} SMs (group {group_size})")
    return W8A16Plan("gemv-dot", cfg, f"M = {m} <= {DOT_MAX_M}: split-K GEMV, {block_m}-row blocks share each "
                                      f"weight tile through tl.dot, {split} K split(s) for {sms} SMs "
                                      f"(group {group_size})")


def _dequant_plan(m: int, limit: int) -> W8A16Plan:
    return W8A16Plan("dequant+cublas", W8A16Config("dequant"),
                     f"M = {m} > {limit}: compute-bound, dequantize to the activation dtype once, then cuBLAS")


def _plan_planes(m: int, k: int, n: int, sms: int, layout: str) -> W8A16Plan:
    """Q6_K: 16-row quarters through tl.dot rows at every M <= 16, 64 columns; Q5_K: one row a program over 128
    columns at M = 1 (tl.dot rows above). K split until about _PLANES_PROGRAMS_PER_SM programs an SM (while each
    split keeps two 64-row chunks), summed in one launch."""
    dot = layout == "q6k" or m > FMA_MAX_M
    block_m, block_n = (16, 64) if dot else (1, 128)
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // 64)
    split = 1
    while split < _PLANES_MAX_SPLIT and tiles * split * 2 <= _PLANES_PROGRAMS_PER_SM * sms and steps >= split * 4:
        split *= 2
    cfg = W8A16Config("gemv", block_m, block_n, 64, split, 4, one_launch=split > 1)
    rows = "the rows share each weight tile through tl.dot (16-row block)" if dot else "one row a program, CUDA-core FMAs"
    return W8A16Plan("gemv-dot" if dot else "gemv", cfg,
                     f"M = {m}: {layout} planes, split-K GEMV, {rows}, {block_n} columns, {split} K split(s) for "
                     f"{sms} SMs in one launch (measured on an H100, kernels-gguf-planes-h100.json)")
