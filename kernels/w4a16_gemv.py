"""Triton W4A16 GEMV (one activation row per program, CUDA-core FMAs, split-K) and the pieces every W4A16 kernel
shares.

All kernels read the K-interleaved kernel layout made by `kernels.w4a16.prepare_w4a16`: K is cut into chunks of
PACK_K rows; word row c*P8 + i (P8 = PACK_K/8) holds, in nibble j, the code of row c*PACK_K + j*P8 + i. Nibble j
of a [P8, BLOCK_N] word tile is thus P8 *consecutive* rows of W, whose activations are one contiguous load: no
reshape, no strided gather. Scales [G, N] and packed zeros [G, ceil(N/8)] keep the standard layout.

Dequantization without int->float conversions (quarter-rate instructions): nibble j sits at bit 4*(j%4) of the
word (j < 4) or of the word shifted right by 16 (j >= 4). OR-ing it, still in place, into the mantissa of 2^23
gives the float 2^23 + q*16^(j%4) exactly; subtracting 2^23 + z*16^(j%4) is exact, and the 16^(j%4) factor is
folded into the scale (or the activations). One LOP3, one FADD and one FMUL/FFMA per weight.
"""
import torch
import triton
import triton.language as tl

MAGIC_BITS = 0x4B000000     # the bits of the float 2^23


@triton.jit
def _group_params(s_ptr, z_ptr, k, G, group_size, stride_sg, stride_zg, offs_n, n_mask,
                  HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr):
    """Scale and zero point as fp32 [1, BLOCK_N] for the group holding row k."""
    g = tl.minimum(k // group_size, G - 1)   # K padding rows clamp to the last group (their activations are 0)
    if EVEN_N:
        s = tl.load(s_ptr + g * stride_sg + offs_n).to(tl.float32)
    else:
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zw = tl.load(z_ptr + g * stride_zg + offs_n // 8, mask=n_mask, other=0)
        z = ((zw >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32)
    else:
        z = s * 0.0 + 8.0                        # symmetric
    return s[None, :], z[None, :]


@triton.jit
def _load_chunk(w_ptr, s_ptr, z_ptr, c, N, G, group_size, stride_sg, stride_zg, offs_i, offs_n, n_mask,
                HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr, PACK_K: tl.constexpr):
    """Word tile [P8, BLOCK_N] of chunk c and its (first) group's scale and zero point [1, BLOCK_N]."""
    w_ptrs = w_ptr + (c * (PACK_K // 8) + offs_i)[:, None] * N + offs_n[None, :]
    if EVEN_N:
        words = tl.load(w_ptrs)
    else:
        words = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
    s, z = _group_params(s_ptr, z_ptr, c * PACK_K, G, group_size, stride_sg, stride_zg, offs_n, n_mask,
                         HAS_ZEROS, EVEN_N)
    return words, s, z


@triton.jit
def _nibble_magic(words, words_hi, magic, J: tl.constexpr):
    """Nibble J of each word as the float 2^23 + q * 16^(J % 4). `magic` (the bits of 2^23) arrives as a kernel
    argument so it lives in a register: with two immediates the and-or would take two LOP3s instead of one."""
    if J < 4:
        bits = (words & (0xF << (4 * J))) | magic
    else:
        bits = (words_hi & (0xF << (4 * (J - 4)))) | magic
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_result(acc, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """acc fp32 [BM, BN] -> the output (bias, cast), or this split's slice of the fp32 workspace [S, M, N]."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, split_k,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (+ bias): a second pass keeps split-K deterministic and needs no memset."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, split_k):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, bias_ptr, M, N, K, G, group_size,
                       stride_xm, stride_om, stride_sg, stride_zg, chunks_per_split, magic,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SLICE_GROUPS: tl.constexpr,
                       SPLIT: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, PACK_K: tl.constexpr):
    """Grid (M, N tiles, splits): rows vary fastest, so a weight tile's programs run together and all but the
    first read it from L2."""
    P8: tl.constexpr = PACK_K // 8
    MAGIC: tl.constexpr = 8388608.0
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_i = tl.arange(0, P8)
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, tl.cdiv(K, PACK_K))
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros([P8, BLOCK_N], dtype=tl.float32)       # reduced over its rows once, after the loop
    words, s, z = _load_chunk(w_ptr, s_ptr, z_ptr, c_begin, N, G, group_size, stride_sg, stride_zg, offs_i, offs_n,
                              n_mask, HAS_ZEROS, EVEN_N, PACK_K)
    for c in range(c_begin, c_end):
        k0 = c * PACK_K
        # the next chunk's loads go out before this chunk's math (the last chunk re-reads itself, from L2)
        words_next, s_next, z_next = _load_chunk(w_ptr, s_ptr, z_ptr, tl.minimum(c + 1, c_end - 1), N, G,
                                                 group_size, stride_sg, stride_zg, offs_i, offs_n, n_mask,
                                                 HAS_ZEROS, EVEN_N, PACK_K)
        words_hi = words >> 16
        part = tl.zeros([P8, BLOCK_N], dtype=tl.float32)  # sum over the chunk of (q - z) * x, scaled once
        for j in tl.static_range(8):
            SH = 1 << (4 * (j % 4))
            if SLICE_GROUPS:
                s, z = _group_params(s_ptr, z_ptr, k0 + j * P8, G, group_size, stride_sg, stride_zg, offs_n,
                                     n_mask, HAS_ZEROS, EVEN_N)
            offs_k = k0 + j * P8 + offs_i
            if EVEN_K:
                xk = tl.load(x_row + offs_k).to(tl.float32)                                # [P8]
            else:
                xk = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            xk = (xk * (1.0 / SH))[:, None]
            t = _nibble_magic(words, words_hi, magic, j) - (z * SH + MAGIC)
            if SLICE_GROUPS:
                acc += (t * xk) * s
            else:
                part += t * xk
        if not SLICE_GROUPS:
            acc += part * s
        words, s, z = words_next, s_next, z_next
    res = tl.sum(acc, axis=0)[None, :]                                             # [1, BLOCK_N]
    offs_m = pid_m + tl.arange(0, 1)
    _store_result(res, out_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, HAS_BIAS, SPLIT)


def split_plan(K: int, pack_k: int, split_k: int) -> tuple[int, int]:
    """(splits actually used, chunks per split): no split is left empty."""
    chunks = triton.cdiv(K, pack_k)
    per = triton.cdiv(chunks, max(1, min(split_k, chunks)))
    return triton.cdiv(chunks, per), per


def launch_splitk_reduce(ws: torch.Tensor, bias, out: torch.Tensor, split_k: int) -> None:
    M, N = out.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
        ws, bias if bias is not None else ws, out, M, N, out.stride(0), split_k,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def w4a16_gemv(x: torch.Tensor, w, bias: torch.Tensor | None, block_n: int, split_k: int,
               num_warps: int, num_stages: int) -> torch.Tensor:
    """x: [M, K] (already act-order permuted, unit stride along K), w: W4A16Weights -> [M, N] in x's dtype."""
    M, K = x.shape
    N = w.qweight.shape[1]
    splits, per = split_plan(K, w.pack_k, split_k)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dst = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    zeros = w.qzeros if w.qzeros is not None else w.qweight
    grid = (M, triton.cdiv(N, block_n), splits)
    _w4a16_gemv_kernel[grid](
        x, w.qweight, w.scales, zeros, dst, bias if bias is not None else w.scales,
        M, N, K, w.scales.shape[0], w.group_size, x.stride(0), out.stride(0), w.scales.stride(0),
        zeros.stride(0), per, MAGIC_BITS,
        HAS_ZEROS=w.qzeros is not None, HAS_BIAS=bias is not None, SLICE_GROUPS=w.slice_groups,
        SPLIT=splits > 1, EVEN_N=N % block_n == 0, EVEN_K=K % w.pack_k == 0, BLOCK_N=block_n, PACK_K=w.pack_k,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        launch_splitk_reduce(dst, bias, out, splits)
    return out
