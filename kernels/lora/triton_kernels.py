"""Batched LoRA as Triton kernels (Punica's BGMV): one program per (token row, tile of outputs), the row's adapter
slot read from `slots` and its A or B rows gathered from the stacked weights. A GEMV per row: the shape of a decode
step; a prefill chunk re-reads its adapter's A for every row (segment-grouped GEMM is the next step, see
docs/serving.md). Contract and numerics: reference.py (fp32 accumulation, h kept in fp32)."""
import torch

from quant_serve.kernels.triton_compat import tl, triton


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = (offs_r < R) & (offs_r * 0 + slot >= 0)  # a base row (slot -1) loads nothing and stores zeros
    slot = tl.maximum(slot, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + row * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row * stride_h + offs_r, acc, mask=offs_r < R)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, R, col_offset, stride_h, stride_bs, stride_bn, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = (offs_n < N) & (offs_n * 0 + slot >= 0)  # a base row (slot -1) reads and writes nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    r_mask = offs_r < R
    h = tl.load(h_ptr + row * stride_h + offs_r, mask=r_mask, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * h[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_y + col_offset + offs_n
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """As lora_shrink_ref: x [T, K] and a [S, R, K] with unit stride along K, slots [T] int32/int64."""
    num_rows, k = x.shape
    r = a.shape[1]
    h = torch.empty(num_rows, r, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return h
    block_r = min(triton.next_power_of_2(r), 64)
    _shrink_kernel[(num_rows, triton.cdiv(r, block_r))](
        x, a, slots, h, k, r, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_K=min(triton.next_power_of_2(k), 128))
    return h


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                       col_offset: int = 0) -> torch.Tensor:
    """As lora_expand_ref: h [T, R] fp32, b [S, N, R] with unit stride along R, y [T, >= col_offset + N] with unit
    stride along its columns (updated in place)."""
    num_rows, r = h.shape
    n = b.shape[1]
    if num_rows == 0:
        return y
    block_n = min(triton.next_power_of_2(n), 128)
    _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        h, b, slots, y, n, r, col_offset, h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(r))
    return y
