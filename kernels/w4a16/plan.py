"""Which W4A16 kernel runs, with which configuration, and why: one pure function of the shape, the GPU's
capability record and the engine's kernel options (`plan_w4a16`), plus the layout a layer is stored in
(`layout_for`). The forward pass (dispatch.py), `quant-serve kernels --explain`, the benchmarks and the offline
fit test all ask here, so what they report is what runs.

On a real device the caps are narrowed once by probes (`probed_runtime`): one tiny call of each Gluon kernel
family, so that a Triton release that broke one costs speed (the next kernel serves, with a warning), never a
forward pass.
"""
import logging
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from quant_serve.kernels.gpu import GPUCaps, KernelOptions, KernelRuntime, runtime_for
from quant_serve.kernels.w4a16.frag import ZP_INT4, ZP_OFFSETS, ZP_Q5, ZP_Q6
from quant_serve.kernels.w4a16.rules import (MMA_MAX_M, TMA_MAX_M, TMA_MIN_M, WGMMA_MAX_M, MMAConfig, TMAConfig,
                                             W4A16Config, measured_on, select_config, select_mma_config,
                                             select_tma_config)
from quant_serve.kernels.w4a8.rules import W4A8Config, plan_w4a8

_logger = logging.getLogger("quant_serve")


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


# ---------------------------------------------------------------------------------------------------------------
# The device: probes narrow the caps once per device.

_PROBED: dict[int, tuple[KernelRuntime, KernelRuntime]] = {}   # device -> (its runtime, that runtime probed)


def probed_runtime(device: torch.device) -> KernelRuntime:
    """The device's runtime with the caps its probes left: wgmma / TMA off where their kernels fail there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    runtime = runtime_for(index)
    seen = _PROBED.get(index)
    if seen is not None and seen[0] is runtime:
        return seen[1]
    caps = runtime.caps
    wgmma = caps.wgmma and _wgmma_works(index)
    tma = caps.tma and runtime.options.tma and _tma_works(index)
    probed = runtime if (wgmma, tma) == (caps.wgmma, caps.tma) else \
        KernelRuntime(replace(caps, wgmma=wgmma, tma=tma), runtime.options)
    _PROBED[index] = (runtime, probed)
    return probed


def frag_layout_works(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _mma_kernels_work(index)


def _probe(device_index: int, kernel: str, cols: int, rows: int, call, fallback: str, offsets: bool = False,
           kquant: bool = False) -> bool:
    """One tiny call of a Gluon kernel before any layer relies on it: `call(x, fw)` over x = ones [rows, 64] and
    codes 0, symmetric (z = 8), scale 1 must give 64 x (0 - 8) = -512 everywhere; with offsets, codes 3, scale 1
    and offset -0.5 must give 64 x 2.5 = 160; kquant: the same through Q4_K's two-level scales (sc = m = 1, d = 1,
    dmin = 0.5, two groups of 32)."""
    from quant_serve.kernels.w4a16.frag import prepare_frag
    from quant_serve.kernels.w4a16.kquant import pack_sub_codes, pack_superscales
    try:
        dev = torch.device("cuda", device_index)
        code_word = 0x33333333 if offsets or kquant else 0
        ones = torch.ones(1, cols, dtype=torch.float16, device=dev)
        words = torch.full((8, cols), code_word, dtype=torch.int32, device=dev)
        if kquant:
            sub = pack_sub_codes(torch.ones(2, cols, device=dev), torch.ones(2, cols, device=dev))
            fw = prepare_frag(words, sub, None, 32, superscales=pack_superscales(ones, 0.5 * ones))
        else:
            fw = prepare_frag(words, ones, None, -1, offsets=-0.5 * ones if offsets else None)
        y = call(torch.ones(rows, 64, dtype=torch.float16, device=dev), fw)
        if bool((y == (160 if offsets or kquant else -512)).all()):
            return True
        reason = f"wrong result {y.flatten()[:4].tolist()}"
    except Exception as e:  # noqa: BLE001 - any compile or launch failure means: the fallback serves
        reason = repr(e)[:300]
    _logger.warning("W4A16 %s unavailable on cuda:%d (%s); %s", kernel, device_index, reason, fallback)
    return False


def frag_offsets_work(device: torch.device, kquant: bool = False) -> bool:
    """The fragment kernels the device's plan can pick dequantize float offsets (kquant: Q4_K's two-level
    scales) right (one probe each, cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _frag_offsets_work(index, kquant)


@lru_cache(maxsize=None)
def _frag_offsets_work(device_index: int, kquant: bool = False) -> bool:
    from quant_serve.kernels.w4a16.mma import w4a16_mma
    from quant_serve.kernels.w4a16.tma import w4a16_tma
    runtime = probed_runtime(torch.device("cuda", device_index))
    what = "k-quant scales" if kquant else "offsets"
    fallback = f"GGUF INT4 layers with {what} use the row-layout kernels"
    flags = dict(kquant=True) if kquant else dict(offsets=True)
    ok = _probe(device_index, f"tensor-core kernel with {what}", 16, 1, w4a16_mma, fallback, **flags)
    if ok and runtime.caps.wgmma:
        ok = _probe(device_index, f"wgmma kernel with {what}", 64, 17,
                    lambda x, fw: w4a16_mma(x, fw, block_n=64, wgmma=True), fallback, **flags)
    if ok and runtime.caps.tma:
        ok = _probe(device_index, f"TMA kernel with {what}", 128, 40,
                    lambda x, fw: w4a16_tma(x, fw, block_n=64, consumers=1), fallback, **flags)
    return ok


def frag6_works(device: torch.device) -> bool:
    """The tensor-core kernels take GGUF Q6_K in the fragment layout (frag6.py) on this device (probed once: codes
    35 = 3 + 32 with both high bits' planes in use, scale 1, x = ones [rows, 64] must give 192)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _frag_hi_works(index, 6)


def frag5_works(device: torch.device) -> bool:
    """The same for GGUF Q5_K (frag5.py): codes 19 = 3 + 16 (the high bit in use), s = 1, o = -16."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _frag_hi_works(index, 5)


@lru_cache(maxsize=None)
def _frag_hi_works(device_index: int, bits: int) -> bool:
    from quant_serve.kernels.w4a16.frag5 import pack_frag5
    from quant_serve.kernels.w4a16.frag6 import pack_frag6
    from quant_serve.kernels.w4a16.mma import w4a16_mma
    runtime = probed_runtime(torch.device("cuda", device_index))
    calls = [("tensor-core kernel", 1, w4a16_mma)]
    if runtime.caps.wgmma:
        calls.append(("wgmma kernel", 17, lambda x, fw: w4a16_mma(x, fw, block_n=64, wgmma=True)))
    dev = torch.device("cuda", device_index)
    if bits == 6:
        fw = pack_frag6(torch.full((64, 64), 3, dtype=torch.int32, device=dev),
                        torch.ones(4, 64, dtype=torch.float16, device=dev))
    else:                                            # (s, o) = (1.0, -16.0) as fp16 bits
        fw = pack_frag5(torch.full((64, 64), 19, dtype=torch.int32, device=dev),
                        torch.full((2, 64), 0x3C00 | (0xCC00 << 16), dtype=torch.int64, device=dev).to(torch.int32))
    for kernel, rows, call in calls:
        try:
            y = call(torch.ones(rows, 64, dtype=torch.float16, device=dev), fw)
            if bool((y == 192).all()):
                continue
            reason = f"wrong result {y.flatten()[:4].tolist()}"
        except Exception as e:  # noqa: BLE001 - any compile or launch failure means: the planes serve
            reason = repr(e)[:300]
        _logger.warning("W4A16 %s with Q%d_K codes unavailable on cuda:%d (%s); Q%d_K layers use the W8A16 plane "
                        "kernels", kernel, bits, device_index, reason, bits)
        return False
    return True


def w4a8_works(device: torch.device) -> bool:
    """The W4A8 kernels (activation quantization + int8 mma.sync) run right on this device (probed once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _w4a8_works(index)


@lru_cache(maxsize=None)
def _w4a8_works(device_index: int) -> bool:
    from quant_serve.kernels.w4a8.mma import w4a8_forward
    return _probe(device_index, "W4A8 kernel", 64, 2, lambda x, fw: w4a8_forward(x, fw, block_m=16),
                  "x stays fp16 (the W4A16 kernels)")


@lru_cache(maxsize=None)
def _mma_kernels_work(device_index: int) -> bool:
    from quant_serve.kernels.w4a16.mma import w4a16_mma
    return _probe(device_index, "tensor-core kernel", 16, 1, w4a16_mma, "using the row-layout kernels")


@lru_cache(maxsize=None)
def _wgmma_works(device_index: int) -> bool:
    from quant_serve.kernels.w4a16.mma import w4a16_mma
    return _probe(device_index, "wgmma kernel", 64, 17, lambda x, fw: w4a16_mma(x, fw, block_n=64, wgmma=True),
                  "M > 16 uses mma.sync up to 64 rows, then dequantize + cuBLAS")


@lru_cache(maxsize=None)
def _tma_works(device_index: int) -> bool:
    """Probed at load (never first inside a CUDA graph capture)."""
    from quant_serve.kernels.w4a16.tma import w4a16_tma
    return _probe(device_index, "TMA kernel", 128, 40, lambda x, fw: w4a16_tma(x, fw, block_n=64, consumers=1),
                  "M > 32 uses the wgmma kernel up to 128 rows, then dequantize + cuBLAS")
