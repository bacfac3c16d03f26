"""Triton W4A16 tiled GEMM (tensor cores, split-K) and the dequantize kernel for the dequantize + cuBLAS path.

Both read the byte layout described in kernels/matmul/rows/gemv.py: a chunk of PACK_K rows is one [P2, BN] byte tile,
dequantized (fp16 inline-asm fast path, or plain fp32) into two [P2, BN] weight tiles -> two dots of K = P2.
SWAP computes acc^T = W^T x^T: the weight tile is the MMA's M side (BN >= 64), the activations its N side, so a
small M does not pad the MMA's M to 16/64 rows.
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.matmul.rows.gemv import (_dequant, _dequant_words, _interleave4, _load_chunk, _load_words,
                                                  fast_dequant_ok, zero_arg)
from quant_serve.kernels.matmul.splitk import _store_result, launch_splitk_reduce, split_buffers, split_plan
from quant_serve.kernels.matmul.rows.layout import weight_bytes


@triton.jit(do_not_specialize=["M", "chunks_per_split", "n_splits"])   # M varies every step: one compile
def _w4a16_gemm_kernel(x_ptr, b_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, bias_ptr, M, N, K, G, group_size,
                       stride_xm, stride_om, stride_sg, stride_zg, chunks_per_split, n_splits, NW,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SLICE_GROUPS: tl.constexpr,
                       SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                       FAST: tl.constexpr, PERMUTED: tl.constexpr, SWAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       OFFSETS: tl.constexpr):
    """Grid (M tiles * N tiles, splits)."""
    P2: tl.constexpr = PACK_K // 2
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M M-tiles walk the N tiles together, so a weight tile is read from DRAM once per group
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, P2)
    # rows past M re-read row M-1 instead of masking: unmasked loads pipeline better; they are never stored
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(K, PACK_K))
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    BJ: tl.constexpr = BLOCK_N // 4
    offs_j = pid_n * BJ + tl.arange(0, BJ)
    j_mask = offs_j < NW
    if FAST:
        cur = _load_words(b_ptr, s_ptr, z_ptr, c_begin, NW, G, group_size, stride_sg, stride_zg, offs_r, offs_j,
                          j_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, PACK_K)
    else:
        cur = _load_chunk(b_ptr, s_ptr, z_ptr, c_begin, N, G, group_size, stride_sg, stride_zg, offs_r, offs_n,
                          n_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, FAST, PERMUTED, PACK_K, OFFSETS)
    for c in range(c_begin, c_end):
        # the next chunk's weights go out before this chunk's math (the last chunk re-reads itself, from L2)
        if FAST:
            nxt = _load_words(b_ptr, s_ptr, z_ptr, tl.minimum(c + 1, c_end - 1), NW, G, group_size, stride_sg,
                              stride_zg, offs_r, offs_j, j_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, PACK_K)
        else:
            nxt = _load_chunk(b_ptr, s_ptr, z_ptr, tl.minimum(c + 1, c_end - 1), N, G, group_size, stride_sg,
                              stride_zg, offs_r, offs_n, n_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, FAST, PERMUTED,
                              PACK_K, OFFSETS)
        k_lo = c * PACK_K + offs_r
        if EVEN_K:
            x_lo = tl.load(x_rows + k_lo[None, :])                                     # [BM, P2]
            x_hi = tl.load(x_rows + (k_lo + P2)[None, :])
        else:
            x_lo = tl.load(x_rows + k_lo[None, :], mask=(k_lo < K)[None, :], other=0.0)
            x_hi = tl.load(x_rows + (k_lo + P2)[None, :], mask=(k_lo + P2 < K)[None, :], other=0.0)
        if FAST:
            l0, l1, l2, l3, h0, h1, h2, h3 = _dequant_words(*cur)
            w_lo = _interleave4(l0, l1, l2, l3)
            w_hi = _interleave4(h0, h1, h2, h3)
        else:
            b, s_lo, z_lo, s_hi, z_hi = cur
            w_lo, w_hi = _dequant(b, s_lo, z_lo, s_hi, z_hi, OFFSETS)
            w_lo = w_lo.to(x_lo.dtype)
            w_hi = w_hi.to(x_lo.dtype)
        if SWAP:
            acc = tl.dot(tl.trans(w_lo), tl.trans(x_lo), acc)                          # [BN, BM]
            acc = tl.dot(tl.trans(w_hi), tl.trans(x_hi), acc)
        else:
            acc = tl.dot(x_lo, w_lo, acc)
            acc = tl.dot(x_hi, w_hi, acc)
        cur = nxt
    if SWAP:
        res = tl.trans(acc)
    else:
        res = acc
    _store_result(res, out_ptr, ws_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, n_splits, pid,
                  HAS_BIAS, SPLIT, ONE_LAUNCH)


@triton.jit
def _w4a16_dequant_kernel(b_ptr, s_ptr, z_ptr, out_ptr, N, K, G, group_size, stride_sg, stride_zg, stride_on, NW,
                          HAS_ZEROS: tl.constexpr, SLICE_GROUPS: tl.constexpr, EVEN_N: tl.constexpr,
                          FAST: tl.constexpr, PERMUTED: tl.constexpr, BLOCK_N: tl.constexpr, PACK_K: tl.constexpr,
                          OFFSETS: tl.constexpr):
    """Grid (K chunks, N tiles): one PACK_K chunk -> W rows [k0, k0 + PACK_K) in natural order."""
    P2: tl.constexpr = PACK_K // 2
    c = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, P2)
    if FAST:
        BJ: tl.constexpr = BLOCK_N // 4
        offs_j = tl.program_id(1) * BJ + tl.arange(0, BJ)
        cur = _load_words(b_ptr, s_ptr, z_ptr, c, NW, G, group_size, stride_sg, stride_zg, offs_r, offs_j,
                          offs_j < NW, HAS_ZEROS, SLICE_GROUPS, EVEN_N, PACK_K)
        l0, l1, l2, l3, h0, h1, h2, h3 = _dequant_words(*cur)
        w_lo = _interleave4(l0, l1, l2, l3)
        w_hi = _interleave4(h0, h1, h2, h3)
    else:
        b, s_lo, z_lo, s_hi, z_hi = _load_chunk(b_ptr, s_ptr, z_ptr, c, N, G, group_size, stride_sg, stride_zg,
                                                offs_r, offs_n, n_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, FAST,
                                                PERMUTED, PACK_K, OFFSETS)
        w_lo, w_hi = _dequant(b, s_lo, z_lo, s_hi, z_hi, OFFSETS)
    k_lo = c * PACK_K + offs_r
    ptrs = out_ptr + k_lo[:, None] * stride_on + offs_n[None, :]
    tl.store(ptrs, w_lo.to(out_ptr.dtype.element_ty), mask=(k_lo < K)[:, None] & n_mask[None, :])
    tl.store(ptrs + P2 * stride_on, w_hi.to(out_ptr.dtype.element_ty),
             mask=(k_lo + P2 < K)[:, None] & n_mask[None, :])


def w4a16_gemm(x: torch.Tensor, w, bias: torch.Tensor | None, block_m: int, block_n: int, split_k: int,
               num_warps: int, num_stages: int, group_m: int = 8, swap: bool = False,
               one_launch: bool = False) -> torch.Tensor:
    """x: [M, K] (already act-order permuted), w: W4A16Weights -> [M, N] in x's dtype. one_launch: split-K
    summed by the last split of each tile (ticket) instead of a second kernel."""
    M, K = x.shape
    N = w.qweight.shape[1]
    splits, per = split_plan(K, w.pack_k, split_k)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    one_launch = one_launch and splits > 1
    out, ws, counters = split_buffers(x, M, N, splits, one_launch, tiles)
    zeros = zero_arg(w)
    fast = fast_dequant_ok(x, w)
    _w4a16_gemm_kernel[(tiles, splits)](
        x, w.qweight if fast else weight_bytes(w), w.scales.view(torch.int32) if fast else w.scales, zeros, out, ws,
        counters, bias if bias is not None else w.scales,
        M, N, K, w.scales.shape[0], w.group_size, x.stride(0), out.stride(0),
        w.scales.stride(0) // 2 if fast else w.scales.stride(0), zeros.stride(0), per, splits, N // 4,
        HAS_ZEROS=w.qzeros is not None, HAS_BIAS=bias is not None, SLICE_GROUPS=w.slice_groups,
        SPLIT=splits > 1, ONE_LAUNCH=one_launch, EVEN_N=N % block_n == 0, EVEN_K=K % w.pack_k == 0, FAST=fast,
        PERMUTED=N % 4 == 0, SWAP=swap, BLOCK_M=block_m, BLOCK_N=block_n, PACK_K=w.pack_k, GROUP_M=group_m,
        OFFSETS=w.offset_mode, num_warps=num_warps, num_stages=num_stages)
    if splits > 1 and not one_launch:
        launch_splitk_reduce(ws, bias, out, splits)
    return out


def w4a16_dequantize(w, dtype: torch.dtype, block_n: int = 128) -> torch.Tensor:
    """W4A16Weights -> dense W [K, N] in `dtype`, rows in internal (act-order) order; one rounding of (q - z) * s
    or q * s + o (fp16: the packed-half fast path, bit-identical; otherwise fp32 math)."""
    K, N = w.in_features, w.qweight.shape[1]
    out = torch.empty((K, N), dtype=dtype, device=w.qweight.device)
    zeros = zero_arg(w)
    grid = (triton.cdiv(K, w.pack_k), triton.cdiv(N, block_n))
    fast = fast_dequant_ok(out, w, dtype)
    _w4a16_dequant_kernel[grid](
        w.qweight if fast else weight_bytes(w), w.scales.view(torch.int32) if fast else w.scales, zeros, out, N, K,
        w.scales.shape[0], w.group_size, w.scales.stride(0) // 2 if fast else w.scales.stride(0),
        zeros.stride(0), out.stride(0), N // 4,
        HAS_ZEROS=w.qzeros is not None, SLICE_GROUPS=w.slice_groups, EVEN_N=N % block_n == 0,
        FAST=fast, PERMUTED=N % 4 == 0, BLOCK_N=block_n, PACK_K=w.pack_k, OFFSETS=w.offset_mode,
        num_warps=4)
    return out


def w4a16_dequant_matmul(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """Large M: the INT4 traffic is negligible next to the FLOPs, so dequantize once and let cuBLAS run."""
    wd = w4a16_dequantize(w, x.dtype)                                                  # [K, N]
    return torch.addmm(bias, x, wd) if bias is not None else torch.mm(x, wd)
