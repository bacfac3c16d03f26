"""Batched LoRA as Triton kernels (Punica's BGMV): each token row's adapter slot is read from `slots` and its A or B
rows gathered from the stacked weights. A GEMV per row: the shape of a decode step; a prefill chunk re-reads its
adapter's A for every row (segment-grouped GEMM is the next step, see docs/serving.md). Contract and numerics:
reference.py (fp32 accumulation, h kept in fp32 as partial sums over splits of K).

shrink: one program per (row, rank tile, split of K), so that a decode step's few rows spread their A (a down
projection's is 18,944 x 16) over many SMs instead of one; expand: one program per (row, tile of output columns)
over all parts of a merged layer at once (one launch for q, k and v), adding up the row's partial h first.
"""
import math

import torch

from quant_serve.kernels.triton_compat import tl, triton

SHRINK_BLOCK_K = 128
SHRINK_MIN_K = 512          # the least K one shrink program takes when the rows are few
SHRINK_PROGRAMS = 256       # about two programs an SM of the largest cards: more splits only add partials


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R, k_chunk, stride_x, stride_as, stride_ar, stride_hs,
                   stride_ht, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:                                  # a base row reads nothing and stores zeros
        a_row = a_ptr + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
        k_start = split * k_chunk
        for k0 in range(k_start, k_start + k_chunk, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + row * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_row + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + split * stride_hs + row * stride_ht + offs_r, acc, mask=r_mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, N, R, n1, n2, splits, stride_hs, stride_ht, stride_bs,
                   stride_bn, stride_y, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:                                  # a base row reads and writes nothing
        n0 = tl.program_id(1) * BLOCK_N
        part = (n0 >= n1).to(tl.int32) + (n0 >= n2).to(tl.int32)   # a tile lies in one part (BLOCK_N | n1, n2)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        h_row = h_ptr + row * stride_ht + part * R + offs_r
        h = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for s in range(0, splits):
            h += tl.load(h_row + s * stride_hs, mask=r_mask, other=0.0)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * h[None, :], axis=1)
        y_ptrs = y_ptr + row * stride_y + offs_n
        y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def shrink_splits(num_rows: int, k: int) -> tuple[int, int]:
    """-> (splits of K, K a split) for a shrink of num_rows rows: shapes only, so a CUDA graph replays one plan."""
    blocks = triton.cdiv(k, SHRINK_BLOCK_K)
    want = max(1, min(triton.cdiv(k, SHRINK_MIN_K), triton.cdiv(SHRINK_PROGRAMS, max(num_rows, 1))))
    per_split = triton.cdiv(blocks, want) * SHRINK_BLOCK_K
    return triton.cdiv(k, per_split), per_split


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """As lora_shrink_ref: x [T, K] and a [S, R, K] with unit stride along K, slots [T] int32/int64 -> h [splits,
    T, R] fp32."""
    num_rows, k = x.shape
    r = a.shape[1]
    splits, k_chunk = shrink_splits(num_rows, k)
    h = torch.empty(splits, num_rows, r, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return h
    block_r = min(triton.next_power_of_2(r), 64)
    _shrink_kernel[(num_rows, triton.cdiv(r, block_r), splits)](
        x, a, slots, h, k, r, k_chunk, x.stride(0), a.stride(0), a.stride(1), h.stride(0), h.stride(1),
        BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K)
    return h


def expand_block_n(part_sizes: list[int]) -> int:
    """The widest tile (<= 128 columns) that divides every boundary between parts, so each tile reads one part's h."""
    bounds = math.gcd(*part_sizes[:-1]) if len(part_sizes) > 1 else 0
    block = 128
    while bounds and bounds % block:
        block //= 2
    return block


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                       part_sizes: list[int] | None = None) -> torch.Tensor:
    """As lora_expand_ref: h [splits, T, parts * R] fp32 with unit stride along R, b [S, N, R] with unit stride along
    R, y [T, N] with unit stride along its columns (updated in place)."""
    splits, num_rows, _ = h.shape
    r = b.shape[2]
    part_sizes = part_sizes or [b.shape[1]]
    if num_rows == 0:
        return y
    block_n = expand_block_n(part_sizes)
    if block_n < 16 or len(part_sizes) > 3:        # odd part sizes, or more parts than n1 / n2 bound: a launch a part
        col = 0
        for i, n in enumerate(part_sizes):
            lora_expand_triton(h[:, :, i * r:(i + 1) * r], b[:, col:col + n], slots, y[:, col:col + n])
            col += n
        return y
    n = sum(part_sizes)
    n1 = part_sizes[0] if len(part_sizes) > 1 else n
    n2 = n1 + part_sizes[1] if len(part_sizes) > 2 else n
    _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        h, b, slots, y, n, r, n1, n2, splits, h.stride(0), h.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(r))
    return y
