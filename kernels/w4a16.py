"""W4A16 entry points: the kernel layouts (`prepare_kernel_weights`) and the dispatcher `w4a16_matmul`.

On CPU tensors everything runs the torch twin (kernels/w4a16_ref.py) on the standard internal layout. On CUDA the
weights are prepared once at load into one of two layouts; passing standard tensors on CUDA repacks on every call
(correct, slow).
Fragment layout (kernels/w4a16_frag.py; fp16 layers with N % 16 == 0, the common case): the Gluon tensor-core
kernel (kernels/w4a16_mma.py; mma.sync up to M = 64, on sm90 wgmma from M = 17 to 128); on sm90 the TMA-fed kernel
(kernels/w4a16_tma.py) from M = 17 to 4096; then a dequantize pass + cuBLAS.
Row layout (W4A16Weights; bf16 and other layers): the Triton kernels read a byte repack of qweight
(kernels/w4a16_gemv.py), paths picked per (M, K, N) from the measured table in kernels/w4a16_tuning.py:
  gemv     one row per program, CUDA-core FMAs, split-K                      (M = 1..few)
           (split-K partials: summed by a second kernel, or, with one_launch, by the last split to arrive)
  gemm     tensor-core tiles, split-K when the tiles alone cannot fill the GPU (M = 2..mid); "gemmt" computes
           y^T = W^T x^T (the weight tile is the MMA's M side)
  dequant  Triton dequantize to a dense W, then cuBLAS                          (large M)
"""
import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from quant_serve.kernels.norm_act import silu_and_mul, silu_and_mul_ref
from quant_serve.kernels.w4a16_frag import FragWeights, frag_standard, prepare_frag
from quant_serve.kernels.w4a16_ref import pack_int4_rows, unpack_int4_rows, w4a16_matmul_ref
from quant_serve.kernels.w4a16_tuning import (TMA_MAX_M, TMA_MIN_M, MMAConfig, TMAConfig, W4A16Config, device_sms,
                                  select_config, select_mma_config, select_tma_config)

DEFAULT_PACK_K = 128


@dataclass
class W4A16Weights:
    """INT4 weights in the kernel layout. qweight: int32 [ceil(K/pack_k)*pack_k/8, N] whose bytes, seen as uint8
    [Kp/2, N], hold per pack_k chunk c and row r < pack_k/2 the codes of rows c*pack_k + r (low nibble) and
    c*pack_k + pack_k/2 + r (high nibble), columns in col_perm order (pad rows hold code 0 and meet zero
    activations); scales [G, N]; qzeros int32 [G, ceil(N/8)] or None."""
    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    group_size: int            # resolved: K for a checkpoint's -1
    in_features: int           # K
    pack_k: int
    perm: torch.Tensor | None  # int64 [K]: y = x[:, perm] @ W

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def slice_groups(self) -> bool:
        """True when a pack_k chunk spans several groups, so scales change per nibble slice."""
        return self.scales.shape[0] > 1 and self.group_size % self.pack_k != 0


def col_perm(n: int, device=None) -> torch.Tensor:
    """Byte position p of a kernel-layout row holds column col_perm(n)[p]: within each group of 4 columns the order
    is (0, 2, 1, 3) (an involution), so one LOP3 on a 4-byte word yields the fp16 pair of columns (n, n+1) and,
    after a shift by 8, the pair (n+2, n+3). Identity when N % 4 != 0 (those shapes take the plain path)."""
    p = torch.arange(n, device=device)
    return p if n % 4 else (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1)


def _to_bytes(codes: torch.Tensor, pack_k: int) -> torch.Tensor:
    """codes [Kp, N] natural order -> uint8 [Kp/2, N]: byte (c*pack_k/2 + r, p) = code[c*pack_k + r, col] |
    code[c*pack_k + pack_k/2 + r, col] << 4, col = col_perm(N)[p]."""
    kp, n = codes.shape
    c = codes.view(kp // pack_k, 2, pack_k // 2, n)
    b = (c[:, 0] | (c[:, 1] << 4)).reshape(kp // 2, n).to(torch.uint8)
    return b[:, col_perm(n, codes.device)]


def _from_bytes(b: torch.Tensor, pack_k: int) -> torch.Tensor:
    kp2, n = b.shape
    b = b[:, col_perm(n, b.device)].to(torch.int32).view(kp2 * 2 // pack_k, 1, pack_k // 2, n)
    return torch.cat([b & 0xF, b >> 4], dim=1).reshape(kp2 * 2, n)


def weight_bytes(w: "W4A16Weights") -> torch.Tensor:
    """The kernel layout's qweight (int32 [Kp/8, N]) seen as its uint8 [Kp/2, N] bytes."""
    kp8, n = w.qweight.shape
    return w.qweight.view(-1).view(torch.uint8).view(kp8 * 4, n)


def prepare_w4a16(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
                  perm: torch.Tensor | None = None, pack_k: int = DEFAULT_PACK_K) -> W4A16Weights:
    """Standard internal layout (kernels/w4a16_ref.py) -> W4A16Weights. Run once at load, on the weights' device."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    gs = k if group_size <= 0 else group_size
    num_groups = scales.shape[0]
    if num_groups != -(-k // gs):
        raise ValueError(f"scales have {num_groups} groups, expected ceil({k}/{gs})")
    if pack_k not in (128, 256, 512):              # pack_k/2 is a dot's K
        raise ValueError(f"pack_k must be 128, 256 or 512, got {pack_k}")
    if num_groups > 1 and gs % (pack_k // 8):
        raise ValueError(f"group size {gs} is not a multiple of pack_k/8 = {pack_k // 8}; use a smaller pack_k")
    kp = -(-k // pack_k) * pack_k
    words = torch.empty((kp // 8, n), dtype=torch.int32, device=qweight.device)
    out = words.view(-1).view(torch.uint8).view(kp // 2, n)
    step = 4096 if n % 4 == 0 else n                      # bounds the temporaries; keeps 4-column groups whole
    for n0 in range(0, n, step):
        codes = unpack_int4_rows(qweight[:, n0:n0 + step])
        codes = torch.cat([codes, codes.new_zeros(kp - k, codes.shape[1])]) if kp > k else codes
        out[:, n0:n0 + step] = _to_bytes(codes, pack_k)
    return W4A16Weights(words, scales.contiguous(), None if qzeros is None else qzeros.contiguous(), gs, k, pack_k,
                        None if perm is None else perm.to(torch.long))


def frag_applies(k: int, n: int, group_size: int, scales_dtype: torch.dtype, device: torch.device) -> bool:
    """The fragment layout and its tensor-core kernels serve this layer: fp16, N % 16 == 0, groups of a multiple
    of 16 rows (or one group), an sm80+ GPU; QUANT_SERVE_W4A16_LAYOUT=rows keeps the row layout everywhere."""
    gs = k if group_size <= 0 else group_size
    return (device.type == "cuda" and os.environ.get("QUANT_SERVE_W4A16_LAYOUT", "auto") != "rows"
            and scales_dtype == torch.float16 and n % 16 == 0 and (gs >= k or gs % 16 == 0)
            and torch.cuda.get_device_capability(device)[0] >= 8
            and _mma_kernels_work(device.index if device.index is not None else torch.cuda.current_device()))


def _probe(device_index: int, kernel: str, cols: int, rows: int, call, fallback: str, sm90: bool = False) -> bool:
    """One tiny call of a Gluon kernel on a device before any layer relies on it: `call(x, fw)` over x = ones
    [rows, 64] and codes 0, symmetric (z = 8), scale 1 must give 64 x (0 - 8) = -512 everywhere. Gluon is Triton's
    experimental layer: a release that changed its API, or a kernel that fails on some GPU, must cost speed (the
    `fallback` serves, with a warning), not a forward pass. sm90: the kernel exists for Hopper only (elsewhere:
    False, no warning)."""
    try:
        if sm90 and torch.cuda.get_device_capability(device_index) != (9, 0):
            return False
        dev = torch.device("cuda", device_index)
        fw = prepare_frag(torch.zeros(8, cols, dtype=torch.int32, device=dev),
                          torch.ones(1, cols, dtype=torch.float16, device=dev), None, -1)
        y = call(torch.ones(rows, 64, dtype=torch.float16, device=dev), fw)
        if bool((y == -512).all()):
            return True
        reason = f"wrong result {y.flatten()[:4].tolist()}"
    except Exception as e:  # noqa: BLE001 - any compile or launch failure means: the fallback serves
        reason = repr(e)[:300]
    logging.getLogger("quant_serve").warning("W4A16 %s unavailable on cuda:%d (%s); %s", kernel, device_index,
                                             reason, fallback)
    return False


@lru_cache(maxsize=None)
def _mma_kernels_work(device_index: int) -> bool:
    """The tensor-core kernel, probed before any layer is packed into the fragment layout for the device."""
    from quant_serve.kernels.w4a16_mma import w4a16_mma
    return _probe(device_index, "tensor-core kernel", 16, 1, w4a16_mma, "using the row-layout kernels")


# QUANT_SERVE_W4A16_TMA=0: M = 17..4096 back on the wgmma kernel / dequantize + cuBLAS (kernels/w4a16_tma.py)
_TMA_ON = os.environ.get("QUANT_SERVE_W4A16_TMA", "1") != "0"


@lru_cache(maxsize=None)
def wgmma_works(device_index: int) -> bool:
    """The wgmma variant serves M = 17..128 on an sm90 GPU where its probe passes. Probed at load."""
    from quant_serve.kernels.w4a16_mma import w4a16_mma
    return _probe(device_index, "wgmma kernel", 64, 17, lambda x, fw: w4a16_mma(x, fw, block_n=64, wgmma=True),
                  "M > 16 uses mma.sync up to 64 rows, then dequantize + cuBLAS", sm90=True)


@lru_cache(maxsize=None)
def tma_works(device_index: int) -> bool:
    """The TMA kernel serves M = 17..4096 on an sm90 GPU where its probe passes. Probed at load (never first inside
    a CUDA graph capture)."""
    from quant_serve.kernels.w4a16_tma import w4a16_tma
    return _probe(device_index, "TMA kernel", 128, 40, lambda x, fw: w4a16_tma(x, fw, block_n=64, consumers=1),
                  "M > 32 uses the wgmma kernel up to 128 rows, then dequantize + cuBLAS", sm90=True)


def prepare_kernel_weights(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                           group_size: int, perm: torch.Tensor | None = None) -> "W4A16Weights | FragWeights":
    """Standard internal layout -> the layout the GPU kernels read: the fragment layout where it applies (tensor
    cores from M = 1), else the row layout. Run once at load, on the weights' device."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if frag_applies(k, n, group_size, scales.dtype, qweight.device):
        index = qweight.device.index if qweight.device.index is not None else torch.cuda.current_device()
        wgmma_works(index)
        tma_works(index)
        return prepare_frag(qweight, scales, qzeros, group_size, perm)
    return prepare_w4a16(qweight, scales, qzeros, group_size, perm)


def standard_layout(w: "W4A16Weights | FragWeights") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Kernel layout -> (qweight [K/8, N], scales, qzeros, group_size) in the standard layout (the twin's input)."""
    if isinstance(w, FragWeights):
        return frag_standard(w)
    codes = _from_bytes(weight_bytes(w), w.pack_k)[: w.in_features]
    return pack_int4_rows(codes), w.scales, w.qzeros, w.group_size


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor | W4A16Weights | FragWeights,
                 scales: torch.Tensor | None = None,
                 qzeros: torch.Tensor | None = None, group_size: int = -1, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, config: W4A16Config | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """x: [..., K] fp16/bf16 -> [..., N] in x's dtype. qweight: standard int32 [K/8, N] (with scales, qzeros,
    group_size, perm) or a W4A16Weights (the other weight arguments are then ignored). config overrides the
    measured dispatch (benchmarks, tests). silu_mul (N = 2I, gate | up): -> [..., I] = silu(gate) * up."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [M, K]
    if not x.is_cuda:
        if isinstance(qweight, (W4A16Weights, FragWeights)):
            perm = qweight.perm
            qweight, scales, qzeros, group_size = standard_layout(qweight)
        y = w4a16_matmul_ref(x2, qweight, scales, qzeros, group_size, perm, bias)
        y = silu_and_mul_ref(y) if silu_mul else y
        return y.reshape(*lead, y.shape[-1])
    w = qweight if isinstance(qweight, (W4A16Weights, FragWeights)) else \
        prepare_kernel_weights(qweight, scales, qzeros, group_size, perm)
    y = w4a16_forward(x2, w, bias, config, silu_mul)
    return y.reshape(*lead, y.shape[-1])


def w4a16_forward(x: torch.Tensor, w: W4A16Weights | FragWeights, bias: torch.Tensor | None = None,
                  config: W4A16Config | MMAConfig | None = None, silu_mul: bool = False) -> torch.Tensor:
    """CUDA path. x: [M, K] -> [M, N], or [M, N/2] = silu(gate) * up with silu_mul (fused into the split-K
    reduce where the kernel has one, else the silu_and_mul kernel after the matmul)."""
    if isinstance(w, FragWeights):
        return _frag_forward(x, w, bias, config, silu_mul)
    from quant_serve.kernels.w4a16_gemm import w4a16_dequant_matmul, w4a16_gemm
    from quant_serve.kernels.w4a16_gemv import w4a16_gemv
    if w.perm is not None:
        x = x[:, w.perm]
    elif x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    cfg = config or select_config(m, k, w.out_features, x.device)
    if cfg.path == "gemv":
        return w4a16_gemv(x, w, bias, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.one_launch,
                          cfg.pipeline, cfg.rows, silu_mul)
    if cfg.path in ("gemm", "gemmt"):
        y = w4a16_gemm(x, w, bias, cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages,
                       swap=cfg.path == "gemmt", one_launch=cfg.one_launch)
    else:
        y = w4a16_dequant_matmul(x, w, bias)
    return silu_and_mul(y) if silu_mul else y


def frag_config(m: int, k: int, n: int, device: torch.device, silu_mul: bool = False,
                tma_fits: bool = True) -> "TMAConfig | MMAConfig | None":
    """What the fragment layout's fp16 dispatch runs for [M, K] x [K, N] on `device`: the TMA kernel's tile on sm90
    (M = 17..4096, where select_tma_config has one, the probe passed, QUANT_SERVE_W4A16_TMA is not 0 and the call's
    x suits TMA: `tma_fits`), else the tensor-core kernel's (select_mma_config), else None (dequantize + cuBLAS).
    One place for the choice: the forward and the benchmark's record of it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _TMA_ON and tma_fits and TMA_MIN_M <= m <= TMA_MAX_M:
        tc = select_tma_config(m, k, n, device_sms(device))
        if tc is not None and tma_works(index):
            return tc
    return select_mma_config(m, k, n, wgmma_works(index), silu_mul, device_sms(device))


def _frag_forward(x: torch.Tensor, w: FragWeights, bias: torch.Tensor | None, config: MMAConfig | None,
                  silu_mul: bool) -> torch.Tensor:
    """Fragment layout: fp16 activations take frag_config's kernel (or `config`), else dequantize + cuBLAS."""
    from quant_serve.kernels.w4a16_mma import w4a16_mma
    from quant_serve.kernels.w4a16_tiles import frag_dequantize
    from quant_serve.kernels.w4a16_tma import tma_works_for, w4a16_tma
    x = x[:, w.perm] if w.perm is not None else x.contiguous()
    m, k = x.shape
    if x.dtype == torch.float16:
        cfg = config or frag_config(m, k, w.out_features, x.device, silu_mul, tma_works_for(x, w))
        if isinstance(cfg, TMAConfig):
            return w4a16_tma(x, w, bias, cfg.block_n, cfg.block_m, cfg.block_k, cfg.stages, cfg.consumers,
                             silu_mul=silu_mul, overlap=cfg.overlap)
        if cfg is not None:
            return w4a16_mma(x, w, bias, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.one_launch,
                             silu_mul, cfg.wgmma, max_regs=cfg.max_regs)
    y = torch.nn.functional.linear(x, frag_dequantize(w).to(x.dtype), bias)
    return silu_and_mul(y) if silu_mul else y
