"""Triton W4A16 GEMV (one activation row per program, CUDA-core FMAs, split-K) and the pieces every W4A16 kernel
shares.

All kernels read the byte layout made by `kernels.w4a16.prepare_w4a16`: K is cut into chunks of PACK_K rows; seen
as uint8 [Kp/2, N], byte (c*P2 + r, p) (P2 = PACK_K/2) holds the code of row c*PACK_K + r in its low nibble and of
row c*PACK_K + P2 + r in its high nibble, for column col_perm(p) (order 0, 2, 1, 3 in each group of 4). A [P2, BN]
byte tile is thus two [P2, BN] weight tiles of consecutive rows (two contiguous activation slices, two dots).

Fast dequant (fp16 activations and scales, N % 4 == 0, compiled): Marlin's trick on a 4-byte word (4 columns):
`lop3(w, 0x000F000F, 0x64006400)` is the fp16 pair (1024 + q) of columns (n, n+1), mask 0x00F000F0 the pair
(1024 + 16 q) of the high nibbles; the word shifted by 8 gives columns (n+2, n+3). Then one exact sub.f16x2
(or fma.f16x2 by 1/16) removes 1024 + z and one mul.f16x2 applies the scale: 13 instructions per 8 weights,
2 weights per lane op, bit-identical to rounding (q - z) * s to fp16 once. Elsewhere (bf16, fp32 output, the CPU
interpreter, which cannot run inline asm) a plain Triton path computes the same values in fp32.
"""

import torch

from quant_serve.kernels.triton_compat import tl, triton, interpreting
from quant_serve.kernels.norm_act import silu_and_mul
from quant_serve.kernels.matmul.splitk import (_store_result, launch_splitk_reduce, split_buffers,  # noqa: F401
                                               split_plan)
from quant_serve.kernels.matmul.rows.layout import weight_bytes

def _dequant_lines(word: int, scale: int, zlo: int, zhi: int) -> str:
    """PTX turning the int32 word $word into 4 fp16x2 registers a0 (low-nibble rows, columns 4j, 4j+1), a2 (4j+2,
    4j+3), a1 and a3 (the high-nibble rows, same columns); scale pairs in $scale, $scale+1, 1024+z pairs in $zlo,
    $zlo+1, -(64+z) pairs in $zhi, $zhi+1."""
    return f"""mov.b32 k16, 0x2C002C00;
lop3.b32 a0, ${word}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, ${word}, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 w1, ${word}, 8;
lop3.b32 a2, w1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a3, w1, 0x00F000F0, 0x64006400, 0xEA;
sub.rn.f16x2 a0, a0, ${zlo};
sub.rn.f16x2 a2, a2, ${zlo + 1};
fma.rn.f16x2 a1, a1, k16, ${zhi};
fma.rn.f16x2 a3, a3, k16, ${zhi + 1};
mul.rn.f16x2 a0, a0, ${scale};
mul.rn.f16x2 a2, a2, ${scale + 1};
mul.rn.f16x2 a1, a1, ${scale};
mul.rn.f16x2 a3, a3, ${scale + 1};
"""


# inputs: word $8 (bytes of columns 4j, 4j+2, 4j+1, 4j+3), scale pairs $9 (4j, 4j+1) $10 (4j+2, 4j+3), 1024+z pairs
# $11 $12, -(64+z) pairs $13 $14; outputs (.b16): low-nibble rows of columns 4j..4j+3 $0..$3, high-nibble rows $4..$7
_DQ_ASM = tl.constexpr("""
{
.reg .b32 w1, a0, a1, a2, a3, k16;
""" + _dequant_lines(8, 9, 11, 13) + """mov.b32 {$0, $1}, a0;
mov.b32 {$2, $3}, a2;
mov.b32 {$4, $5}, a1;
mov.b32 {$6, $7}, a3;
}
""")
# the GEMV's version: same dequant, then acc_t += w_lo_t * x_lo + w_hi_t * x_hi in fp32 for the 4 columns.
# outputs acc $0..$3; inputs word $4, scale pairs $5 $6, 1024+z pairs $7 $8, -(64+z) pairs $9 $10, x_lo $11,
# x_hi $12, acc $13..$16
_DQ_FMA_ASM = tl.constexpr("""
{
.reg .b32 w1, a0, a1, a2, a3, k16;
.reg .b16 h<8>;
.reg .f32 f<8>;
""" + _dequant_lines(4, 5, 7, 9) + """mov.b32 {h0, h1}, a0;
mov.b32 {h2, h3}, a2;
mov.b32 {h4, h5}, a1;
mov.b32 {h6, h7}, a3;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
cvt.f32.f16 f2, h2;
cvt.f32.f16 f3, h3;
cvt.f32.f16 f4, h4;
cvt.f32.f16 f5, h5;
cvt.f32.f16 f6, h6;
cvt.f32.f16 f7, h7;
fma.rn.f32 f0, f0, $11, $13;
fma.rn.f32 f1, f1, $11, $14;
fma.rn.f32 f2, f2, $11, $15;
fma.rn.f32 f3, f3, $11, $16;
fma.rn.f32 $0, f4, $12, f0;
fma.rn.f32 $1, f5, $12, f1;
fma.rn.f32 $2, f6, $12, f2;
fma.rn.f32 $3, f7, $12, f3;
}
""")
ZLO_BASE = tl.constexpr(0x64006400)                 # fp16 pair (1024, 1024)
ZHI_BASE = tl.constexpr(0xD400D400 - (1 << 32))     # fp16 pair (-64, -64), as a signed int32; + 16 z per half gives -(64 + z)


def fast_dequant_ok(x: torch.Tensor, w, out_dtype: torch.dtype | None = None) -> bool:
    """The inline-asm fp16 dequant applies: compiled CUDA, fp16 activations and scales, N % 4 == 0, integer zero
    points (float offsets take the plain path: GGUF's groups of 32 slice a chunk, which the fast path never takes
    either)."""
    return (x.is_cuda and not interpreting() and w.scales.dtype == torch.float16
            and not w.slice_groups and w.offset_mode == 0
            and (out_dtype or x.dtype) == torch.float16 and w.qweight.shape[1] % 4 == 0
            and w.scales.stride(-1) == 1)


def zero_arg(w) -> torch.Tensor:
    """The row-layout kernels' zero-point argument: packed int4 zeros, the float offsets (OFFSETS), or any tensor
    (symmetric: never read)."""
    if w.superscales is not None:
        return w.superscales
    return w.qzeros if w.qzeros is not None else w.offsets if w.offsets is not None else w.qweight


@triton.jit
def _group_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask,
                  HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr, OFFSETS: tl.constexpr = False):
    """Scale (its own dtype) and zero point (fp32) of group g (a scalar -> [1, BN], or [R, 1] -> [R, BN]).
    OFFSETS: z_ptr holds float offsets [G, N] (stride_zg) and the second value is the group's offset (fp32); it
    takes the zero point's registers, so an offset layer holds no more than a zero-point one."""
    if OFFSETS == 2:                  # k-quant: int16 sub-codes, int32 d | dmin (no early return: one return type)
        s, z = _kquant_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask, EVEN_N)
    else:
        s, z = _float_group_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS, EVEN_N,
                                   OFFSETS)
    return s, z


@triton.jit
def _float_group_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS: tl.constexpr,
                        EVEN_N: tl.constexpr, OFFSETS: tl.constexpr):
    if EVEN_N:
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :])
    else:
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=n_mask[None, :], other=0.0)
    if OFFSETS:
        if EVEN_N:
            z = tl.load(z_ptr + g * stride_zg + offs_n[None, :]).to(tl.float32)
        else:
            z = tl.load(z_ptr + g * stride_zg + offs_n[None, :], mask=n_mask[None, :], other=0.0).to(tl.float32)
    elif HAS_ZEROS:
        zw = tl.load(z_ptr + g * stride_zg + (offs_n // 8)[None, :], mask=n_mask[None, :], other=0)
        z = ((zw >> ((offs_n % 8) * 4)[None, :]) & 0xF).to(tl.float32)
    else:
        z = s.to(tl.float32) * 0.0 + 8.0                        # symmetric
    return s, z


@triton.jit
def _kquant_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask, EVEN_N: tl.constexpr):
    """Q4_K's group g (kernels/matmul/frag/kquant.py) -> (scale f32(d) * sc, offset -f32(dmin) * m), both fp32: the
    products gguf.quants.dequantize forms, exact in fp32."""
    if EVEN_N:
        sm = tl.load(s_ptr + g * stride_sg + offs_n[None, :]).to(tl.int32)
        dd = tl.load(z_ptr + (g // 8) * stride_zg + offs_n[None, :])
    else:
        sm = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=n_mask[None, :], other=0).to(tl.int32)
        dd = tl.load(z_ptr + (g // 8) * stride_zg + offs_n[None, :], mask=n_mask[None, :], other=0)
    d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d * (sm & 0xFF).to(tl.float32), -(dmin * ((sm >> 8) & 0xFF).to(tl.float32))


@triton.jit
def _load_chunk(b_ptr, s_ptr, z_ptr, c, N, G, group_size, stride_sg, stride_zg, offs_r, offs_n, n_mask,
                HAS_ZEROS: tl.constexpr, SLICE_GROUPS: tl.constexpr, EVEN_N: tl.constexpr, FAST: tl.constexpr,
                PERMUTED: tl.constexpr, PACK_K: tl.constexpr, OFFSETS: tl.constexpr = False):
    """Byte tile [P2, BN] of chunk c (memory column order when FAST, else real order) and the groups' scales and
    zero points (OFFSETS: float offsets) for its low rows (k0 + r) and high rows (k0 + P2 + r)."""
    P2: tl.constexpr = PACK_K // 2
    if FAST or not PERMUTED:
        cols = offs_n
    else:
        cols = (offs_n - (offs_n & 3)) | ((offs_n & 1) << 1) | ((offs_n >> 1) & 1)
    ptrs = b_ptr + (c * P2 + offs_r)[:, None] * N + cols[None, :]
    if EVEN_N:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=n_mask[None, :], other=0)
    k0 = c * PACK_K
    if SLICE_GROUPS:
        g_lo = tl.minimum((k0 + offs_r) // group_size, G - 1)[:, None]
        g_hi = tl.minimum((k0 + P2 + offs_r) // group_size, G - 1)[:, None]
        s_lo, z_lo = _group_params(s_ptr, z_ptr, g_lo, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS, EVEN_N,
                                   OFFSETS)
        s_hi, z_hi = _group_params(s_ptr, z_ptr, g_hi, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS, EVEN_N,
                                   OFFSETS)
    else:
        g = tl.minimum(k0 // group_size, G - 1)   # K padding rows clamp to the last group (their activations are 0)
        s_lo, z_lo = _group_params(s_ptr, z_ptr, g, stride_sg, stride_zg, offs_n, n_mask, HAS_ZEROS, EVEN_N,
                                   OFFSETS)
        s_hi, z_hi = s_lo, z_lo
    return b, s_lo, z_lo, s_hi, z_hi


@triton.jit
def _load_words(w_ptr, s2_ptr, z_ptr, c, NW, G, group_size, stride_s2, stride_zg, offs_r, offs_j, j_mask,
                HAS_ZEROS: tl.constexpr, SLICE_GROUPS: tl.constexpr, EVEN_N: tl.constexpr, PACK_K: tl.constexpr):
    """Fast path: word tile [P2, BJ] (word j = columns 4j..4j+3) of chunk c, scale pairs (fp16x2 as int32) and the
    packed zero constants of the low and high rows' groups."""
    P2: tl.constexpr = PACK_K // 2
    ptrs = w_ptr + (c * P2 + offs_r)[:, None] * NW + offs_j[None, :]
    if EVEN_N:
        wd = tl.load(ptrs)
    else:
        wd = tl.load(ptrs, mask=j_mask[None, :], other=0)
    k0 = c * PACK_K
    if SLICE_GROUPS:
        g_lo = tl.minimum((k0 + offs_r) // group_size, G - 1)[:, None]
        g_hi = tl.minimum((k0 + P2 + offs_r) // group_size, G - 1)[:, None]
        sa_lo, sb_lo, za_lo, zb_lo = _pair_params(s2_ptr, z_ptr, g_lo, stride_s2, stride_zg, offs_j, j_mask, HAS_ZEROS)
        sa_hi, sb_hi, za_hi, zb_hi = _pair_params(s2_ptr, z_ptr, g_hi, stride_s2, stride_zg, offs_j, j_mask, HAS_ZEROS)
    else:
        g = tl.minimum(k0 // group_size, G - 1)
        sa_lo, sb_lo, za_lo, zb_lo = _pair_params(s2_ptr, z_ptr, g, stride_s2, stride_zg, offs_j, j_mask, HAS_ZEROS)
        sa_hi, sb_hi, za_hi, zb_hi = sa_lo, sb_lo, za_lo, zb_lo
    return wd, sa_lo, sb_lo, za_lo, zb_lo, sa_hi, sb_hi, za_hi, zb_hi


@triton.jit
def _pair_params(s2_ptr, z_ptr, g, stride_s2, stride_zg, offs_j, j_mask, HAS_ZEROS: tl.constexpr):
    """Scale pairs (4j, 4j+1), (4j+2, 4j+3) as int32 and the zero codes packed the same way (z | z' << 16)."""
    sa = tl.load(s2_ptr + g * stride_s2 + (2 * offs_j)[None, :], mask=j_mask[None, :], other=0)
    sb = tl.load(s2_ptr + g * stride_s2 + (2 * offs_j + 1)[None, :], mask=j_mask[None, :], other=0)
    if HAS_ZEROS:
        zz = tl.load(z_ptr + g * stride_zg + (offs_j // 2)[None, :], mask=j_mask[None, :], other=0)
        zz = zz >> ((offs_j % 2) * 16)[None, :]
        za = (zz & 0xF) | (((zz >> 4) & 0xF) << 16)
        zb = ((zz >> 8) & 0xF) | (((zz >> 12) & 0xF) << 16)
    else:
        za = sa * 0 + (8 | (8 << 16))
        zb = za
    return sa, sb, za, zb


@triton.jit
def _dequant_words(wd, sa_lo, sb_lo, za_lo, zb_lo, sa_hi, sb_hi, za_hi, zb_hi):
    """-> 8 fp16 tensors [P2, BJ]: low rows of columns 4j+0..3, then high rows of columns 4j+0..3."""
    return tl.inline_asm_elementwise(
        _DQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r",
        [wd, sa_lo, sb_lo, za_lo + ZLO_BASE, zb_lo + ZLO_BASE, (za_hi << 4) + ZHI_BASE, (zb_hi << 4) + ZHI_BASE],
        dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _interleave4(a, b, c, d):
    """Four [R, BJ] tensors (columns 4j + 0..3) -> [R, 4 BJ] in column order."""
    t = tl.join(tl.join(a, c), tl.join(b, d))                                     # [R, BJ, 2, 2]
    return tl.reshape(t, [a.shape[0], a.shape[1] * 4])


@triton.jit
def _dequant(b, s_lo, z_lo, s_hi, z_hi, OFFSETS: tl.constexpr = False):
    """Plain path: -> (W rows k0 + r, W rows k0 + P2 + r), each fp32 [P2, BN], real column order. OFFSETS: z_* are
    float offsets, W = q * s + o; else zero points, W = (q - z) * s."""
    if OFFSETS:
        lo = (b & 0xF).to(tl.float32) * s_lo.to(tl.float32) + z_lo
        hi = (b >> 4).to(tl.float32) * s_hi.to(tl.float32) + z_hi
    else:
        lo = ((b & 0xF).to(tl.float32) - z_lo) * s_lo.to(tl.float32)
        hi = ((b >> 4).to(tl.float32) - z_hi) * s_hi.to(tl.float32)
    return lo, hi


@triton.jit
def _x_rows(x_row, c, offs_r, K, EVEN_K: tl.constexpr, PACK_K: tl.constexpr):
    """Activations of the low rows (c*PACK_K + r) and high rows (+ P2) of a row block, fp32 [R]."""
    k_lo = c * PACK_K + offs_r
    if EVEN_K:
        x_lo = tl.load(x_row + k_lo)
        x_hi = tl.load(x_row + k_lo + PACK_K // 2)
    else:
        x_lo = tl.load(x_row + k_lo, mask=k_lo < K, other=0.0)
        x_hi = tl.load(x_row + k_lo + PACK_K // 2, mask=k_lo + PACK_K // 2 < K, other=0.0)
    return x_lo.to(tl.float32), x_hi.to(tl.float32)


@triton.jit
def _fma_words(words, x_lo, x_hi, a0, a1, a2, a3):
    """Fast path: a_t [R, BJ] += dequant(word tile) * x for the 4 columns 4j+t of each word (one asm per word)."""
    wd, sa, sb, za, zb, _, _, _, _ = words                              # one group per chunk (not SLICE_GROUPS)
    return tl.inline_asm_elementwise(
        _DQ_FMA_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [wd, sa, sb, za + ZLO_BASE, zb + ZLO_BASE, (za << 4) + ZHI_BASE, (zb << 4) + ZHI_BASE, x_lo[:, None],
         x_hi[:, None], a0, a1, a2, a3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _fma_bytes(tile, x_lo, x_hi, acc, OFFSETS: tl.constexpr):
    """Plain path: acc [R, BN] += dequant(byte tile) * x."""
    b, s_lo, z_lo, s_hi, z_hi = tile
    w_lo, w_hi = _dequant(b, s_lo, z_lo, s_hi, z_hi, OFFSETS)
    return acc + w_lo * x_lo[:, None] + w_hi * x_hi[:, None]


@triton.jit(do_not_specialize=["M", "chunks_per_split", "n_splits"])
def _w4a16_gemv_kernel(x_ptr, b_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, bias_ptr, M, N, K, G, group_size,
                       stride_xm, stride_om, stride_sg, stride_zg, chunks_per_split, n_splits, NW,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SLICE_GROUPS: tl.constexpr,
                       SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                       FAST: tl.constexpr, PERMUTED: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                       STAGES: tl.constexpr, PACK_K: tl.constexpr, OFFSETS: tl.constexpr):
    """Grid (M, N tiles, splits): rows vary fastest, so a weight tile's programs run together and all but the
    first read it from L2. A step covers ROWS rows of a chunk's byte/word tile (ROWS = PACK_K/2: the whole chunk);
    STAGES = 0 prefetches the next step into registers, STAGES >= 2 loads inside tl.range(num_stages=STAGES), which
    Triton turns into a cp.async ring of STAGES - 1 steps in flight through shared memory."""
    RPC: tl.constexpr = PACK_K // 2 // ROWS                               # steps per chunk
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    i_begin = pid_k * chunks_per_split * RPC
    i_end = tl.minimum((pid_k + 1) * chunks_per_split, tl.cdiv(K, PACK_K)) * RPC
    x_row = x_ptr + pid_m * stride_xm
    if FAST:
        BJ: tl.constexpr = BLOCK_N // 4
        offs_j = pid_n * BJ + tl.arange(0, BJ)
        j_mask = offs_j < NW
        a0 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        a1 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        a2 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        a3 = tl.zeros([ROWS, BJ], dtype=tl.float32)
        if STAGES == 0:
            cur = _load_words(b_ptr, s_ptr, z_ptr, i_begin // RPC, NW, G, group_size, stride_sg, stride_zg,
                              (i_begin % RPC) * ROWS + tl.arange(0, ROWS), offs_j, j_mask, HAS_ZEROS, SLICE_GROUPS,
                              EVEN_N, PACK_K)
            for i in range(i_begin, i_end):
                # the next step's loads go out before this step's math (the last step re-reads itself, from L2)
                i_nx = tl.minimum(i + 1, i_end - 1)
                nxt = _load_words(b_ptr, s_ptr, z_ptr, i_nx // RPC, NW, G, group_size, stride_sg, stride_zg,
                                  (i_nx % RPC) * ROWS + tl.arange(0, ROWS), offs_j, j_mask, HAS_ZEROS, SLICE_GROUPS,
                                  EVEN_N, PACK_K)
                x_lo, x_hi = _x_rows(x_row, i // RPC, (i % RPC) * ROWS + tl.arange(0, ROWS), K, EVEN_K, PACK_K)
                a0, a1, a2, a3 = _fma_words(cur, x_lo, x_hi, a0, a1, a2, a3)
                cur = nxt
        else:
            for i in tl.range(i_begin, i_end, num_stages=STAGES):
                offs_r = (i % RPC) * ROWS + tl.arange(0, ROWS)
                cur = _load_words(b_ptr, s_ptr, z_ptr, i // RPC, NW, G, group_size, stride_sg, stride_zg, offs_r,
                                  offs_j, j_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, PACK_K)
                x_lo, x_hi = _x_rows(x_row, i // RPC, offs_r, K, EVEN_K, PACK_K)
                a0, a1, a2, a3 = _fma_words(cur, x_lo, x_hi, a0, a1, a2, a3)
        res = _interleave4(tl.sum(a0, axis=0)[None, :], tl.sum(a1, axis=0)[None, :], tl.sum(a2, axis=0)[None, :],
                           tl.sum(a3, axis=0)[None, :])
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)       # reduced over its rows once, after the loop
        if STAGES == 0:
            cur = _load_chunk(b_ptr, s_ptr, z_ptr, i_begin // RPC, N, G, group_size, stride_sg, stride_zg,
                              (i_begin % RPC) * ROWS + tl.arange(0, ROWS), offs_n, n_mask, HAS_ZEROS, SLICE_GROUPS,
                              EVEN_N, FAST, PERMUTED, PACK_K, OFFSETS)
            for i in range(i_begin, i_end):
                i_nx = tl.minimum(i + 1, i_end - 1)
                nxt = _load_chunk(b_ptr, s_ptr, z_ptr, i_nx // RPC, N, G, group_size, stride_sg, stride_zg,
                                  (i_nx % RPC) * ROWS + tl.arange(0, ROWS), offs_n, n_mask, HAS_ZEROS, SLICE_GROUPS,
                                  EVEN_N, FAST, PERMUTED, PACK_K, OFFSETS)
                x_lo, x_hi = _x_rows(x_row, i // RPC, (i % RPC) * ROWS + tl.arange(0, ROWS), K, EVEN_K, PACK_K)
                acc = _fma_bytes(cur, x_lo, x_hi, acc, OFFSETS)
                cur = nxt
        else:
            for i in tl.range(i_begin, i_end, num_stages=STAGES):
                offs_r = (i % RPC) * ROWS + tl.arange(0, ROWS)
                cur = _load_chunk(b_ptr, s_ptr, z_ptr, i // RPC, N, G, group_size, stride_sg, stride_zg, offs_r,
                                  offs_n, n_mask, HAS_ZEROS, SLICE_GROUPS, EVEN_N, FAST, PERMUTED, PACK_K, OFFSETS)
                x_lo, x_hi = _x_rows(x_row, i // RPC, offs_r, K, EVEN_K, PACK_K)
                acc = _fma_bytes(cur, x_lo, x_hi, acc, OFFSETS)
        res = tl.sum(acc, axis=0)[None, :]                                     # [1, BLOCK_N]
    offs_m = pid_m + tl.arange(0, 1)
    _store_result(res, out_ptr, ws_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, n_splits,
                  pid_m * tl.num_programs(1) + pid_n, HAS_BIAS, SPLIT, ONE_LAUNCH)


def w4a16_gemv(x: torch.Tensor, w, bias: torch.Tensor | None, block_n: int, split_k: int, num_warps: int,
               num_stages: int, one_launch: bool = False, pipeline: bool = False, rows: int = 0,
               silu_mul: bool = False) -> torch.Tensor:
    """x: [M, K] (already act-order permuted, unit stride along K), w: W4A16Weights -> [M, N] in x's dtype.
    one_launch: split-K summed by the last split (ticket) instead of a second kernel; pipeline: loads in
    tl.range(num_stages) instead of the register prefetch; rows: tile rows per step (0: pack_k/2, a chunk).
    silu_mul (N = 2I, gate | up): -> [M, I] = silu(gate) * up, computed by the split-K reduce when there is one."""
    M, K = x.shape
    N = w.qweight.shape[1]
    rows = rows or w.pack_k // 2
    if (w.pack_k // 2) % rows:
        raise ValueError(f"rows={rows} must divide pack_k/2 = {w.pack_k // 2}")
    splits, per = split_plan(K, w.pack_k, split_k)
    n_tiles = triton.cdiv(N, block_n)
    one_launch = one_launch and splits > 1
    fused = silu_mul and splits > 1 and not one_launch             # the reduce pass applies silu(gate) * up
    out, ws, counters = split_buffers(x, M, N, splits, one_launch, M * n_tiles, N // 2 if fused else 0)
    zeros = zero_arg(w)
    fast = fast_dequant_ok(x, w)
    # fast path: int32 words [Kp/2, N/4] and fp16 scale pairs as int32 [G, N/2]
    _w4a16_gemv_kernel[(M, n_tiles, splits)](
        x, w.qweight if fast else weight_bytes(w), w.scales.view(torch.int32) if fast else w.scales, zeros, out, ws,
        counters, bias if bias is not None else w.scales,
        M, N, K, w.scales.shape[0], w.group_size, x.stride(0), out.stride(0),
        w.scales.stride(0) // 2 if fast else w.scales.stride(0), zeros.stride(0), per, splits, N // 4,
        HAS_ZEROS=w.qzeros is not None, HAS_BIAS=bias is not None, SLICE_GROUPS=w.slice_groups,
        SPLIT=splits > 1, ONE_LAUNCH=one_launch, EVEN_N=N % block_n == 0, EVEN_K=K % w.pack_k == 0, FAST=fast,
        PERMUTED=N % 4 == 0, BLOCK_N=block_n, ROWS=rows, STAGES=num_stages if pipeline else 0, PACK_K=w.pack_k,
        OFFSETS=w.offset_mode, num_warps=num_warps, num_stages=num_stages)
    if splits > 1 and not one_launch:
        launch_splitk_reduce(ws, bias, out, splits, silu_mul=fused)   # [M, N/2] when fused
        return out
    return silu_and_mul(out) if silu_mul else out
