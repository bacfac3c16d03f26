"""Triton W4A16 tiled GEMM (tensor cores, split-K) and the dequantize kernel for the dequantize + cuBLAS path.

Both read the K-interleaved kernel layout described in kernels/w4a16_gemv.py.
"""
import torch
import triton
import triton.language as tl

from kernels.w4a16_gemv import (MAGIC_BITS, _group_params, _load_chunk, _nibble_magic, _store_result,
                                 launch_splitk_reduce, split_plan)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, bias_ptr, M, N, K, G, group_size,
                       stride_xm, stride_om, stride_sg, stride_zg, chunks_per_split, magic,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SLICE_GROUPS: tl.constexpr,
                       SPLIT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (M tiles * N tiles, splits). Each PACK_K chunk is 8 dots of K = PACK_K/8, one per nibble."""
    P8: tl.constexpr = PACK_K // 8
    MAGIC: tl.constexpr = 8388608.0
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
    offs_i = tl.arange(0, P8)
    # rows past M re-read row M-1 instead of masking: unmasked loads pipeline better; they are never stored
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(K, PACK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    words, s, z = _load_chunk(w_ptr, s_ptr, z_ptr, c_begin, N, G, group_size, stride_sg, stride_zg, offs_i, offs_n,
                              n_mask, HAS_ZEROS, EVEN_N, PACK_K)
    for c in range(c_begin, c_end):
        k0 = c * PACK_K
        # the next chunk's weights go out before this chunk's math (the last chunk re-reads itself, from L2)
        words_next, s_next, z_next = _load_chunk(w_ptr, s_ptr, z_ptr, tl.minimum(c + 1, c_end - 1), N, G,
                                                 group_size, stride_sg, stride_zg, offs_i, offs_n, n_mask,
                                                 HAS_ZEROS, EVEN_N, PACK_K)
        words_hi = words >> 16
        for j in tl.static_range(8):
            SH = 1 << (4 * (j % 4))
            if SLICE_GROUPS:
                s, z = _group_params(s_ptr, z_ptr, k0 + j * P8, G, group_size, stride_sg, stride_zg, offs_n,
                                     n_mask, HAS_ZEROS, EVEN_N)
            offs_k = k0 + j * P8 + offs_i
            if EVEN_K:
                xk = tl.load(x_rows + offs_k[None, :])                                      # [BM, P8]
            else:
                xk = tl.load(x_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
            t = _nibble_magic(words, words_hi, magic, j) - (z * SH + MAGIC)
            wk = (t * (s * (1.0 / SH))).to(xk.dtype)                                         # [P8, BN]
            acc = tl.dot(xk, wk, acc)
        words, s, z = words_next, s_next, z_next
    _store_result(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, HAS_BIAS, SPLIT)


@triton.jit
def _w4a16_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, G, group_size, stride_sg, stride_zg, stride_on,
                          magic,
                          HAS_ZEROS: tl.constexpr, SLICE_GROUPS: tl.constexpr, EVEN_N: tl.constexpr,
                          BLOCK_N: tl.constexpr, PACK_K: tl.constexpr):
    """Grid (K chunks, N tiles): one PACK_K chunk -> W rows [k0, k0 + PACK_K) in natural order."""
    P8: tl.constexpr = PACK_K // 8
    MAGIC: tl.constexpr = 8388608.0
    c = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_i = tl.arange(0, P8)
    k0 = c * PACK_K
    words = tl.load(w_ptr + (c * P8 + offs_i)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    words_hi = words >> 16
    s, z = _group_params(s_ptr, z_ptr, k0, G, group_size, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS, EVEN_N)
    for j in tl.static_range(8):
        SH = 1 << (4 * (j % 4))
        if SLICE_GROUPS:
            s, z = _group_params(s_ptr, z_ptr, k0 + j * P8, G, group_size, stride_sg, stride_zg, offs_n, n_mask,
                                 HAS_ZEROS, EVEN_N)
        offs_k = k0 + j * P8 + offs_i
        t = _nibble_magic(words, words_hi, magic, j) - (z * SH + MAGIC)
        wk = t * (s * (1.0 / SH))
        mask = (offs_k < K)[:, None] & n_mask[None, :]
        tl.store(out_ptr + offs_k[:, None] * stride_on + offs_n[None, :], wk.to(out_ptr.dtype.element_ty), mask=mask)


def w4a16_gemm(x: torch.Tensor, w, bias: torch.Tensor | None, block_m: int, block_n: int, split_k: int,
               num_warps: int, num_stages: int, group_m: int = 8) -> torch.Tensor:
    """x: [M, K] (already act-order permuted), w: W4A16Weights -> [M, N] in x's dtype."""
    M, K = x.shape
    N = w.qweight.shape[1]
    splits, per = split_plan(K, w.pack_k, split_k)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dst = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n), splits)
    _w4a16_gemm_kernel[grid](
        x, w.qweight, w.scales, zeros, dst, bias if bias is not None else w.scales,
        M, N, K, w.scales.shape[0], w.group_size, x.stride(0), out.stride(0), w.scales.stride(0),
        zeros.stride(0), per, MAGIC_BITS,
        HAS_ZEROS=w.qzeros is not None, HAS_BIAS=bias is not None, SLICE_GROUPS=w.slice_groups,
        SPLIT=splits > 1, EVEN_N=N % block_n == 0, EVEN_K=K % w.pack_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        PACK_K=w.pack_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        launch_splitk_reduce(dst, bias, out, splits)
    return out


def w4a16_dequantize(w, dtype: torch.dtype, block_n: int = 128) -> torch.Tensor:
    """W4A16Weights -> dense W [K, N] in `dtype`, rows in internal (act-order) order; fp32 math, one rounding."""
    K, N = w.in_features, w.qweight.shape[1]
    out = torch.empty((K, N), dtype=dtype, device=w.qweight.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight
    grid = (triton.cdiv(K, w.pack_k), triton.cdiv(N, block_n))
    _w4a16_dequant_kernel[grid](
        w.qweight, w.scales, zeros, out, N, K, w.scales.shape[0], w.group_size, w.scales.stride(0),
        zeros.stride(0), out.stride(0), MAGIC_BITS,
        HAS_ZEROS=w.qzeros is not None, SLICE_GROUPS=w.slice_groups, EVEN_N=N % block_n == 0, BLOCK_N=block_n,
        PACK_K=w.pack_k, num_warps=4)
    return out


def w4a16_dequant_matmul(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """Large M: the INT4 traffic is negligible next to the FLOPs, so dequantize once and let cuBLAS run."""
    wd = w4a16_dequantize(w, x.dtype)                                                  # [K, N]
    return torch.addmm(bias, x, wd) if bias is not None else torch.mm(x, wd)
