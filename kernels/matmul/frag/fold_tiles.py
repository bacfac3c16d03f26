"""The pieces of the decode step's folded RMSNorm that run inside the mma kernel (kernels/matmul/frag/mma.py, RESIDUAL /
NORM): the residual epilogue that leaves the stream's sums of squares, and the norm applied while x is staged.
The launchers and twins are in fold.py."""
from dataclasses import dataclass

import torch

from quant_serve.kernels.triton_compat import gl, gluon

FOLD_TILE = 64          # the residual epilogue sums squares by this many columns (its tile)


@dataclass
class FoldedNorm:
    """An RMSNorm for a matmul to apply to its x: ss [M, tiles] fp32, the sums of squares of x by `tile` columns
    (the residual epilogue's output), weight [K] and eps of the norm."""
    ss: torch.Tensor
    weight: torch.Tensor
    eps: float
    tile: int = FOLD_TILE


@gluon.jit
def _write_residual(acc, r, out_ptr, bias_ptr, ss_ptr, on, om, M, N, mask, stride_om, pid_n, tiles,
                    HAS_BIAS: gl.constexpr):
    """acc fp32 [BLOCK_N, BLOCK_M] (y^T), r the residual's tile -> out = round(round(y) + r) (the matmul's output,
    then torch's add, as _rms_norm_kernel rounds them); ss[m, pid_n] = sum of out^2 over the tile's columns."""
    if HAS_BIAS:
        acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
    h = (acc.to(out_ptr.dtype.element_ty).to(gl.float32) + r.to(gl.float32)).to(out_ptr.dtype.element_ty)
    gl.store(out_ptr + om[None, :] * stride_om + on[:, None], h, mask=mask)
    hf = gl.where(mask, h.to(gl.float32), 0.0)
    gl.store(ss_ptr + om * tiles + pid_n, gl.sum(hf * hf, axis=0), mask=om < M)


@gluon.jit
def _rms_normed(h, gamma, ss_ptr, ss_count, eps, K, SS_P2: gl.constexpr, num_warps: gl.constexpr):
    """h: a row segment of the stream [X] (fp16), gamma the norm weight's same segment, ss[:ss_count] the row's sums
    of squares by tile -> RMSNorm(h) * gamma, rounded as _rms_norm_kernel rounds (fp16 normed, then the product)."""
    sl = gl.arange(0, SS_P2, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    variance = gl.sum(gl.load(ss_ptr + sl, mask=sl < ss_count, other=0.0), axis=0) / K
    normed = (h.to(gl.float32) * gl.rsqrt(variance + eps)).to(h.dtype)
    return (normed.to(gl.float32) * gamma.to(gl.float32)).to(h.dtype)
