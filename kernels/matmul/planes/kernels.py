"""Triton W8A16 kernels over the int8 layout of reference.py (GGUF Q8_0, Q5_*, Q6_K), the Q6_K planes (q6k.py) and
the Q5_K planes (q5k.py, the Q5 constexpr: its decoder and K loop live there): a split-K GEMV for few rows
and a dequantize pass for the dequantize + cuBLAS path. Which runs is plan.plan_w8a16's choice.

A step reads a [BLOCK_K, BLOCK_N] tile of int8 codes (rows of N bytes, coalesced along N), its groups' scales and
offsets, and dequantizes in fp32: w = q * s + o. GROUP (a constexpr: 16, 32, 256 for GGUF; 2^30 for one group) a
multiple of BLOCK_K (ROW_SCALES): one scale row a step; otherwise each tile row gathers its group's scales (the
same few rows, from L1), which is right for any group size.
Q6 (GGUF Q6_K at 6 bits, q6k.py): a step is one 64-row chunk: its 32 low-plane byte rows give rows j (low
nibble) and 32 + j (high nibble), each completed by its 2 bits of the high plane, and their scales f32(d) * sc
from the int8 sub-scales (s_ptr) and the fp16 super-scale d (o_ptr), as gguf forms them. The GEMV reads a chunk
as four 16-row quarters (each plane row and each sub-scale row loaded once, the scale a [1, BLOCK_N] row); the
dequantize pass as two 32-row halves.
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.matmul.planes.q5k import Q5_CHUNK, Q5_GROUP, Q5KWeights, _q5_chunk, _q5_rows
from quant_serve.kernels.matmul.planes.q6k import Q6_CHUNK, Q6_GROUP, Q6KWeights
from quant_serve.kernels.matmul.splitk import _store_result, launch_splitk_reduce, split_buffers, split_plan


@triton.jit
def _dequant_tile(q_ptr, s_ptr, o_ptr, k, offs_n, k_mask, n_mask, stride_qk, stride_sg, k_step,
                  HAS_OFFSETS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """W rows k ([BLOCK_K], starting at k_step) x columns offs_n -> fp32 [BLOCK_K, BLOCK_N]. Rows past K hold the
    group's offset (their activations are 0)."""
    ROW_SCALES: tl.constexpr = GROUP % BLOCK_K == 0
    mask = k_mask[:, None] & n_mask[None, :]
    q = tl.load(q_ptr + k[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0)
    if ROW_SCALES:
        g = k_step // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=n_mask[None, :], other=0.0)
    else:
        g = k // GROUP
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0)
    w = q.to(tl.float32) * s.to(tl.float32)
    if HAS_OFFSETS:
        if ROW_SCALES:
            o = tl.load(o_ptr + g * stride_sg + offs_n[None, :], mask=n_mask[None, :], other=0.0)
        else:
            o = tl.load(o_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=mask, other=0.0)
        w = w + o.to(tl.float32)
    return w


@triton.jit
def _q6_chunk(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K):
    """Q6 planes, 64-row chunk c (q6k.py) -> (W rows 64 c + j, W rows 64 c + 32 + j), each fp32 [32, BLOCK_N]: the
    low plane's 32 byte rows once, the high plane's 16 rows twice (the repeat from L1), s = d * sc as gguf forms
    it (the chunk lies in one super-block)."""
    j = tl.arange(0, 32)
    mask = n_mask[None, :]
    lo = tl.load(q_ptr + (c * 32 + j)[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    hb = tl.load(q_ptr + (K // 2 + c * 16 + j % 16)[:, None] * stride_qk + offs_n[None, :], mask=mask,
                 other=0).to(tl.int32)
    t = ((j // 16) * 2)[:, None]                                 # rows 16 t + j % 16 of the chunk: bits 2t, 2t + 1
    q_a = ((lo & 0xF) | (((hb >> t) & 3) << 4)) - 32
    q_b = ((lo >> 4) | (((hb >> (t + 4)) & 3) << 4)) - 32
    g = (c * 4 + j // 16)[:, None]                               # sub-scale rows; + 2 for the chunk's upper half
    s_a = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    s_b = tl.load(s_ptr + (g + 2) * stride_sg + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    d = tl.load(o_ptr + (c // 4) * stride_sg + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return q_a.to(tl.float32) * (d * s_a), q_b.to(tl.float32) * (d * s_b)


@triton.jit
def _q6_quarters(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K):
    """Q6 planes, 64-row chunk c -> rows 64 c + 16 t + j (t = 0..3) as fp32 [16, BLOCK_N] each: codes u - 32 times
    f32(d) * sc (gguf's products), each plane row and each sub-scale row loaded once."""
    j = tl.arange(0, 16)
    mask = n_mask[None, :]
    cols = offs_n[None, :]
    lo0 = tl.load(q_ptr + (c * 32 + j)[:, None] * stride_qk + cols, mask=mask, other=0).to(tl.int32)
    lo1 = tl.load(q_ptr + (c * 32 + 16 + j)[:, None] * stride_qk + cols, mask=mask, other=0).to(tl.int32)
    hb = tl.load(q_ptr + (K // 2 + c * 16 + j)[:, None] * stride_qk + cols, mask=mask, other=0).to(tl.int32)
    d = tl.load(o_ptr + (c // 4) * stride_sg + cols, mask=mask, other=0.0).to(tl.float32)        # [1, BN]
    s_row = s_ptr + (c * 4) * stride_sg + cols
    s0 = d * _i8_to_f32(tl.load(s_row, mask=mask, other=0))
    s1 = d * _i8_to_f32(tl.load(s_row + stride_sg, mask=mask, other=0))
    s2 = d * _i8_to_f32(tl.load(s_row + 2 * stride_sg, mask=mask, other=0))
    s3 = d * _i8_to_f32(tl.load(s_row + 3 * stride_sg, mask=mask, other=0))
    # quarter t: low nibble of lo0 / lo1 (t 0, 1) or high nibble (t 2, 3), top bits 2t, 2t + 1 of hb moved to 4, 5
    w0 = _u6_minus_32((lo0 & 15) | ((hb << 4) & 48)) * s0
    w1 = _u6_minus_32((lo1 & 15) | ((hb << 2) & 48)) * s1
    w2 = _u6_minus_32((lo0 >> 4) | (hb & 48)) * s2
    w3 = _u6_minus_32((lo1 >> 4) | ((hb >> 2) & 48)) * s3
    return w0, w1, w2, w3


@triton.jit
def _i8_to_f32(v):
    """int8 -> fp32, exact, by the same mantissa trick (each thread converts its own copy of a sub-scale row)."""
    return (v.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _u6_minus_32(u):
    """int32 codes 0..63 -> fp32 u - 32, exact: u in the mantissa of 2^23 (an OR) minus 2^23 + 32 (an FADD), in
    place of the int-to-float conversion, which issues at a quarter of the FP32 rate."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0


@triton.jit
def _q6_quarter_rows(x_ptr, q_ptr, s_ptr, o_ptr, pid_m, M, K, stride_xm, stride_qk, stride_sg, st_begin, st_end,
                     offs_n, n_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMV's K loop over Q6 planes, one 64-row chunk a step in quarters -> [BLOCK_M, BLOCK_N] fp32 (BLOCK_M
    1: FMA rows; 16: four tl.dot of 16 rows a step)."""
    j = tl.arange(0, 16)
    if BLOCK_M == 1:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_xm
        for c in range(st_begin, st_end):
            w0, w1, w2, w3 = _q6_quarters(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K)
            xc = x_row + c * 64 + j
            acc += w0 * tl.load(xc).to(tl.float32)[:, None]
            acc += w1 * tl.load(xc + 16).to(tl.float32)[:, None]
            acc += w2 * tl.load(xc + 32).to(tl.float32)[:, None]
            acc += w3 * tl.load(xc + 48).to(tl.float32)[:, None]
        res = tl.sum(acc, axis=0)[None, :]                                      # [1, BLOCK_N]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(st_begin, st_end):
            w0, w1, w2, w3 = _q6_quarters(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K)
            xc = x_rows + (c * 64 + j)[None, :]                                   # [BM, 16]
            x0 = tl.load(xc)
            acc = tl.dot(x0, w0.to(x0.dtype), acc)
            acc = tl.dot(tl.load(xc + 16), w1.to(x0.dtype), acc)
            acc = tl.dot(tl.load(xc + 32), w2.to(x0.dtype), acc)
            acc = tl.dot(tl.load(xc + 48), w3.to(x0.dtype), acc)
        res = acc
    return res


@triton.jit(do_not_specialize=["M", "steps_per_split", "n_splits"])
def _w8a16_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, out_ptr, ws_ptr, cnt_ptr, bias_ptr, M, N, K,
                       stride_xm, stride_om, stride_qk, stride_sg, steps_per_split, n_splits,
                       HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       ONE_LAUNCH: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, Q6: tl.constexpr = False,
                       Q5: tl.constexpr = False):
    """Grid (row blocks, N tiles, splits). BLOCK_M 1: one x row a program, CUDA-core FMAs into an fp32
    [BLOCK_K, BLOCK_N] accumulator summed over its rows after the loop (rows of a weight tile run together, so all
    but the first read it from L2). BLOCK_M 16 / 32 / 64: the row block's x [BLOCK_M, BLOCK_K] meets the tile
    rounded to x's dtype in tl.dot (the weights are read once for up to BLOCK_M rows)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_kk = tl.arange(0, BLOCK_K)
    st_begin = pid_k * steps_per_split
    st_end = tl.minimum(st_begin + steps_per_split, tl.cdiv(K, BLOCK_K))
    if Q6:                                          # K % 64 == 0 (whole chunks), BLOCK_K == 64
        res = _q6_quarter_rows(x_ptr, q_ptr, s_ptr, o_ptr, pid_m, M, K, stride_xm, stride_qk, stride_sg, st_begin,
                               st_end, offs_n, n_mask, BLOCK_M, BLOCK_N)
    elif Q5:                                        # K % 64 == 0 (whole chunks), BLOCK_K == 64
        res = _q5_rows(x_ptr, q_ptr, s_ptr, o_ptr, pid_m, M, K, stride_xm, stride_qk, stride_sg, st_begin, st_end,
                       offs_n, n_mask, BLOCK_M, BLOCK_N)
    elif BLOCK_M == 1:
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_xm
        for st in range(st_begin, st_end):
            k = st * BLOCK_K + offs_kk
            k_mask = k < K
            w = _dequant_tile(q_ptr, s_ptr, o_ptr, k, offs_n, k_mask, n_mask, stride_qk, stride_sg, st * BLOCK_K,
                              HAS_OFFSETS, GROUP, BLOCK_K)
            xv = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            acc += w * xv[:, None]
        res = tl.sum(acc, axis=0)[None, :]                                      # [1, BLOCK_N]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        # rows past M re-read row M - 1 (never stored): unmasked rows pipeline better
        x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for st in range(st_begin, st_end):
            k = st * BLOCK_K + offs_kk
            k_mask = k < K
            w = _dequant_tile(q_ptr, s_ptr, o_ptr, k, offs_n, k_mask, n_mask, stride_qk, stride_sg, st * BLOCK_K,
                              HAS_OFFSETS, GROUP, BLOCK_K)
            xt = tl.load(x_rows + k[None, :], mask=k_mask[None, :], other=0.0)        # [BM, BK]
            acc = tl.dot(xt, w.to(xt.dtype), acc)
        res = acc
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    _store_result(res, out_ptr, ws_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, n_splits,
                  pid_m * tl.num_programs(1) + pid_n, HAS_BIAS, SPLIT, ONE_LAUNCH)


@triton.jit
def _w8a16_dequant_kernel(q_ptr, s_ptr, o_ptr, out_ptr, N, K, stride_qk, stride_sg, stride_ok,
                          HAS_OFFSETS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, Q6: tl.constexpr = False, Q5: tl.constexpr = False):
    """Grid (K steps, N tiles): W rows [k0, k0 + BLOCK_K) -> out [K, N] in out's dtype (one rounding)."""
    st = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if Q6 or Q5:                                    # one 64-row chunk a program, as two 32-row halves
        j = tl.arange(0, 32)
        if Q6:
            w_a, w_b = _q6_chunk(q_ptr, s_ptr, o_ptr, st, offs_n, n_mask, stride_qk, stride_sg, K)
        else:
            w_a, w_b = _q5_chunk(q_ptr, s_ptr, o_ptr, st, offs_n, n_mask, stride_qk, stride_sg, K)
        rows = out_ptr + (st * 64 + j)[:, None] * stride_ok + offs_n[None, :]
        tl.store(rows, w_a.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
        tl.store(rows + 32 * stride_ok, w_b.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
    else:
        k = st * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = _dequant_tile(q_ptr, s_ptr, o_ptr, k, offs_n, k_mask, n_mask, stride_qk, stride_sg, st * BLOCK_K,
                          HAS_OFFSETS, GROUP, BLOCK_K)
        tl.store(out_ptr + k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=k_mask[:, None] & n_mask[None, :])


ONE_GROUP = 1 << 30       # GROUP for a layer with one scale group (group_size -1 or K): every row's group is 0


def group_arg(group_size: int, k: int) -> int:
    """The kernels' GROUP constexpr for a layer's group size."""
    return group_size if 0 < group_size < k else ONE_GROUP


def _layout_args(qweight, scales, offsets, group_size, block_k):
    """The kernels' (codes, scales, third pointer, offsets, group, Q6, Q5) for int8 codes as given, or for the
    code planes of Q6KWeights (int8 sub-scales, fp16 d) and Q5KWeights (int16 sub-codes, int32 d | dmin), whose
    scales travel inside the weights and which run one 64-row chunk a step."""
    if not isinstance(qweight, (Q6KWeights, Q5KWeights)):
        return qweight, scales, offsets if offsets is not None else scales, offsets, group_size, False, False
    q6 = isinstance(qweight, Q6KWeights)
    name, chunk = ("Q6_K", Q6_CHUNK) if q6 else ("Q5_K", Q5_CHUNK)
    sub, sup = (qweight.sub_scales, qweight.d) if q6 else (qweight.sub_codes, qweight.superscales)
    if block_k != chunk:
        raise ValueError(f"{name} planes run one chunk a step: block_k must be {chunk}, got {block_k}")
    if sub.stride(0) != sup.stride(0):
        raise ValueError(f"{name} sub-scales and super-scales must share their row stride (contiguous [G, N])")
    return qweight.planes, sub, sup, None, Q6_GROUP if q6 else Q5_GROUP, q6, not q6


def w8a16_gemv(x: torch.Tensor, qweight: "torch.Tensor | Q6KWeights | Q5KWeights", scales: torch.Tensor | None,
               offsets: torch.Tensor | None, group_size: int, bias: torch.Tensor | None, block_m: int = 1,
               block_n: int = 64, block_k: int = 64, split_k: int = 1, num_warps: int = 4,
               one_launch: bool = False) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ W [K, N] (int8 codes, scales / offsets [G, N], or Q6KWeights: scales and
    offsets ignored) -> [M, N] in x's dtype. block_m 1: one row a program (CUDA-core FMAs); 16 (32, 64 for int8
    codes): up to that many rows a program through tl.dot."""
    qweight, scales, third, offsets, group_size, q6, q5 = _layout_args(qweight, scales, offsets, group_size, block_k)
    M, K = x.shape
    N = qweight.shape[1]
    if block_m not in (1, 16, 32, 64) or (block_m > 16 and (q6 or q5)):
        raise ValueError(f"block_m must be 1 (FMA rows) or 16 (tl.dot rows; 32 or 64 for int8 codes), got {block_m}")
    splits, per = split_plan(K, block_k, split_k)
    row_blocks = triton.cdiv(M, block_m)
    n_tiles = triton.cdiv(N, block_n)
    one_launch = one_launch and splits > 1
    out, ws, counters = split_buffers(x, M, N, splits, one_launch, row_blocks * n_tiles)
    _w8a16_gemv_kernel[(row_blocks, n_tiles, splits)](
        x, qweight, scales, third, out, ws, counters,
        bias if bias is not None else out, M, N, K, x.stride(0), out.stride(0), qweight.stride(0),
        scales.stride(0), per, splits,
        HAS_OFFSETS=offsets is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1, ONE_LAUNCH=one_launch,
        GROUP=group_arg(group_size, K), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        Q6=q6, Q5=q5, num_warps=num_warps)
    if splits > 1 and not one_launch:
        launch_splitk_reduce(ws, bias, out, splits)
    return out


def w8a16_dequantize(qweight: "torch.Tensor | Q6KWeights | Q5KWeights", scales: torch.Tensor | None,
                     offsets: torch.Tensor | None, group_size: int, dtype: torch.dtype, block_n: int = 64,
                     block_k: int = 64) -> torch.Tensor:
    """int8 layout (or Q6KWeights) -> dense W [K, N] in dtype, one rounding of q * s + o (fp32 math)."""
    K = qweight.in_features if isinstance(qweight, (Q6KWeights, Q5KWeights)) else qweight.shape[0]
    qweight, scales, third, offsets, group_size, q6, q5 = _layout_args(qweight, scales, offsets, group_size, block_k)
    N = qweight.shape[1]
    out = torch.empty((K, N), dtype=dtype, device=qweight.device)
    _w8a16_dequant_kernel[(triton.cdiv(K, block_k), triton.cdiv(N, block_n))](
        qweight, scales, third, out, N, K, qweight.stride(0),
        scales.stride(0), out.stride(0), HAS_OFFSETS=offsets is not None, GROUP=group_arg(group_size, K),
        BLOCK_N=block_n, BLOCK_K=block_k, Q6=q6, Q5=q5, num_warps=4)
    return out


def w8a16_dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                         offsets: torch.Tensor | None, group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows: the 8-bit traffic is small next to the FLOPs; dequantize once to x's dtype, then cuBLAS."""
    wd = w8a16_dequantize(qweight, scales, offsets, group_size, x.dtype)                 # [K, N]
    return torch.addmm(bias, x, wd) if bias is not None else torch.mm(x, wd)
