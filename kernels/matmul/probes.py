"""The device narrows the plan's caps once: one tiny call of each Gluon kernel family (`probed_runtime` and the
`*_works` probes), so that a Triton release that broke one costs speed (the next kernel serves, with a warning),
never a forward pass. The plan itself (plan.py) is a pure function of the caps these leave."""
import logging
from dataclasses import replace
from functools import lru_cache

import torch

from quant_serve.kernels.gpu import KernelRuntime, runtime_for

_logger = logging.getLogger("quant_serve")

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
    from quant_serve.kernels.matmul.frag.layout import prepare_frag
    from quant_serve.kernels.matmul.frag.kquant import pack_sub_codes, pack_superscales
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
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
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
    from quant_serve.kernels.matmul.frag.q5k import pack_frag5
    from quant_serve.kernels.matmul.frag.q6k import pack_frag6
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
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
    from quant_serve.kernels.matmul.int8.mma import w4a8_forward
    return _probe(device_index, "W4A8 kernel", 64, 2, lambda x, fw: w4a8_forward(x, fw, block_m=16),
                  "x stays fp16 (the W4A16 kernels)")


@lru_cache(maxsize=None)
def _mma_kernels_work(device_index: int) -> bool:
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    return _probe(device_index, "tensor-core kernel", 16, 1, w4a16_mma, "using the row-layout kernels")


@lru_cache(maxsize=None)
def _wgmma_works(device_index: int) -> bool:
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    return _probe(device_index, "wgmma kernel", 64, 17, lambda x, fw: w4a16_mma(x, fw, block_n=64, wgmma=True),
                  "M > 16 uses mma.sync up to 64 rows, then dequantize + cuBLAS")


@lru_cache(maxsize=None)
def _tma_works(device_index: int) -> bool:
    """Probed at load (never first inside a CUDA graph capture)."""
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    return _probe(device_index, "TMA kernel", 128, 40, lambda x, fw: w4a16_tma(x, fw, block_n=64, consumers=1),
                  "M > 32 uses the wgmma kernel up to 128 rows, then dequantize + cuBLAS")
