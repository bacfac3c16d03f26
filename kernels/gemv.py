"""Dense FP16/BF16 GEMV for one row against a vocabulary-wide weight: the unquantized lm_head of a batch-1 decode
step, which streams the whole head (1.09 GB on Qwen2.5-7B) every token.

cuBLAS's pick for [1, 3584] x [3584, 152064] reads at 4.16 TB/s on the H200 (261.9 us in a CUDA graph), this
kernel (eight rows a program, 512-column steps in a three-stage cp.async pipeline) at 4.48 TB/s (243.1 us;
bench/results/exp-head-gemv-h200.json). It
sums in fp32 and rounds once, as cuBLAS does, in another order. Under PDL it is launched while the final norm
runs. The torch twin is F.linear.
"""
import torch

from quant_serve.kernels.gpu import runtime_for
from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.pdl import launch_options, pdl_enabled, pdl_start, pdl_wait

MIN_ROWS = 65536        # vocabulary-wide weights only: the shape the kernel was measured on
BLOCK_N, BLOCK_K, STAGES, WARPS = 8, 512, 3, 4


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """out[n] = sum_k w[n, k] x[k] for BLOCK_N rows n (fp32 sum, one rounding to out's dtype)."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    pdl_wait(PDL)                                   # x is the previous kernel's output
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        col_mask = k0 + cols < K
        # each weight is read once: keep the L2 for x and the next kernels
        w = tl.load(w_rows + (k0 + cols)[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                    eviction_policy="evict_first")                                          # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + k0 + cols, mask=col_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=row_mask)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One fp16/bf16 row on CUDA against a vocabulary-wide weight of its dtype with unit column stride, where the
    device's KernelOptions.head_gemv is on (off: cuBLAS)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.shape[0] >= MIN_ROWS and weight.stride(1) == 1
            and runtime_for(x.device).options.head_gemv)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T -> [1, N] in x's dtype (F.linear without bias)."""
    n, k = weight.shape
    if x.shape != (1, k):
        raise ValueError(f"gemv takes one row of {k} features, got x of shape {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](x, weight, out, n, weight.stride(0), K=k, BLOCK_N=BLOCK_N,
                                             BLOCK_K=BLOCK_K, STAGES=STAGES, PDL=pdl, num_warps=WARPS,
                                             **launch_options(pdl))
    return out
