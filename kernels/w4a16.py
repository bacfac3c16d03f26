"""W4A16 entry points: the kernel layout (`prepare_w4a16`) and the dispatcher `w4a16_matmul`.

On CPU tensors everything runs the torch twin (kernels/w4a16_ref.py) on the standard internal layout. On CUDA the
weights should be prepared once at load: the Triton kernels read a K-interleaved repack of qweight (see
kernels/w4a16_gemv.py); passing standard tensors on CUDA repacks on every call (correct, slow).
Paths, picked per (M, K, N) from the measured table in kernels/w4a16_tuning.py:
  gemv     one row per program, CUDA-core FMAs, split-K                      (M = 1..few)
  gemm     tensor-core tiles, split-K when the tiles alone cannot fill the GPU (M = 2..mid)
  dequant  Triton dequantize to a dense W, then cuBLAS                          (large M)
"""
from dataclasses import dataclass

import torch

from kernels.w4a16_ref import pack_int4_rows, unpack_int4_rows, w4a16_matmul_ref
from kernels.w4a16_tuning import W4A16Config, select_config

DEFAULT_PACK_K = 128


@dataclass
class W4A16Weights:
    """INT4 weights in the kernel layout. qweight: int32 [ceil(K/pack_k)*pack_k/8, N], K-interleaved per chunk
    (pad rows hold code 0 and meet zero activations); scales [G, N]; qzeros int32 [G, ceil(N/8)] or None."""
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


def _interleave(codes: torch.Tensor, pack_k: int) -> torch.Tensor:
    """codes [Kp, N] natural order -> [Kp, N] in word order: row (c, i, j) holds natural row c*pack_k + j*P8 + i."""
    kp, n = codes.shape
    return codes.view(kp // pack_k, 8, pack_k // 8, n).transpose(1, 2).reshape(kp, n)


def _deinterleave(codes: torch.Tensor, pack_k: int) -> torch.Tensor:
    kp, n = codes.shape
    return codes.view(kp // pack_k, pack_k // 8, 8, n).transpose(1, 2).reshape(kp, n)


def prepare_w4a16(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
                  perm: torch.Tensor | None = None, pack_k: int = DEFAULT_PACK_K) -> W4A16Weights:
    """Standard internal layout (kernels/w4a16_ref.py) -> W4A16Weights. Run once at load, on the weights' device."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    gs = k if group_size <= 0 else group_size
    num_groups = scales.shape[0]
    if num_groups != -(-k // gs):
        raise ValueError(f"scales have {num_groups} groups, expected ceil({k}/{gs})")
    if pack_k not in (128, 256, 512):              # pack_k/8 is a dot's K: at least 16
        raise ValueError(f"pack_k must be 128, 256 or 512, got {pack_k}")
    if num_groups > 1 and gs % (pack_k // 8):
        raise ValueError(f"group size {gs} is not a multiple of pack_k/8 = {pack_k // 8}; use a smaller pack_k")
    kp = -(-k // pack_k) * pack_k
    words = torch.empty((kp // 8, n), dtype=torch.int32, device=qweight.device)
    for n0 in range(0, n, 4096):                          # bounds the int64 temporaries to K x 4096
        codes = unpack_int4_rows(qweight[:, n0:n0 + 4096])
        codes = torch.cat([codes, codes.new_zeros(kp - k, codes.shape[1])]) if kp > k else codes
        words[:, n0:n0 + 4096] = pack_int4_rows(_interleave(codes, pack_k))
    return W4A16Weights(words, scales.contiguous(), None if qzeros is None else qzeros.contiguous(), gs, k, pack_k,
                        None if perm is None else perm.to(torch.long))


def standard_layout(w: W4A16Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """W4A16Weights -> (qweight [K/8, N], scales, qzeros, group_size) in the standard layout (the twin's input)."""
    codes = _deinterleave(unpack_int4_rows(w.qweight), w.pack_k)[: w.in_features]
    return pack_int4_rows(codes), w.scales, w.qzeros, w.group_size


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor | W4A16Weights, scales: torch.Tensor | None = None,
                 qzeros: torch.Tensor | None = None, group_size: int = -1, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, config: W4A16Config | None = None) -> torch.Tensor:
    """x: [..., K] fp16/bf16 -> [..., N] in x's dtype. qweight: standard int32 [K/8, N] (with scales, qzeros,
    group_size, perm) or a W4A16Weights (the other weight arguments are then ignored). config overrides the
    measured dispatch (benchmarks, tests)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [M, K]
    if not x.is_cuda:
        if isinstance(qweight, W4A16Weights):
            perm = qweight.perm
            qweight, scales, qzeros, group_size = standard_layout(qweight)
        y = w4a16_matmul_ref(x2, qweight, scales, qzeros, group_size, perm, bias)
        return y.reshape(*lead, y.shape[-1])
    w = qweight if isinstance(qweight, W4A16Weights) else prepare_w4a16(qweight, scales, qzeros, group_size, perm)
    y = w4a16_forward(x2, w, bias, config)
    return y.reshape(*lead, y.shape[-1])


def w4a16_forward(x: torch.Tensor, w: W4A16Weights, bias: torch.Tensor | None = None,
                  config: W4A16Config | None = None) -> torch.Tensor:
    """CUDA path. x: [M, K] -> [M, N]."""
    from kernels.w4a16_gemm import w4a16_dequant_matmul, w4a16_gemm
    from kernels.w4a16_gemv import w4a16_gemv
    if w.perm is not None:
        x = x[:, w.perm]
    elif x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    cfg = config or select_config(m, k, w.out_features, x.device)
    if cfg.path == "gemv":
        return w4a16_gemv(x, w, bias, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages)
    if cfg.path == "gemm":
        return w4a16_gemm(x, w, bias, cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages)
    return w4a16_dequant_matmul(x, w, bias)
