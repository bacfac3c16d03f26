"""Gluon building blocks of the fragment layout (kernels/matmul/frag/layout.py) and its dequantize pass.

A program's weight tile [BLOCK_N, BLOCK_K] of W^T is loaded as int32 words in `word_layout`: each word holds the
8 codes one thread holds in one mma.sync m16n8k16 A fragment, so the dequantized values ARE the MMA's A operand
(`convert_layout(..., assert_trivial=True)` checks it at compile time): no shared memory, no shuffles. Dequant is
Marlin's LOP3 trick on the word (13 instructions per 8 weights, exact). The matmul kernels are in
kernels/matmul/frag/mma.py; the dequantize pass here writes the dense W^T for cuBLAS above their M.
"""
import torch

from quant_serve.kernels.triton_compat import gl, gluon, triton
from quant_serve.kernels.matmul.frag.layout import FragWeights, pick_block_k
from quant_serve.kernels.matmul.frag.q5k import _q5_by_word, _q5_dequant, _q5_hi_load, _q5_pairs
from quant_serve.kernels.matmul.frag.q6k import _even_words, _q6_by_word, _q6_dequant, _q6_hi_load

def _frag_dq_asm(scaled: bool, offsets: bool = False) -> str:
    """Marlin's LOP3 dequant of one fragment word. Inputs: word $8, then (scaled) the scale pairs of rows g ($9) and
    g + 8 ($10), then the (1024 + z) pair of row g and the -(64 + z) pair of row g + 8. Outputs (.b16): value index
    b0 + 2 b1 + 4 b2 = (k + b0 + 8 b2, n + 8 b1) of the thread's fragment. Unscaled: q - z, exact, for steps inside
    one scale group, whose scales multiply the MMA's partial sums instead (kernels/matmul/frag/mma.py).
    offsets (scaled): $11 and $12 are the float offset pairs of rows g and g + 8; q comes out exact (z = 0) and one
    fma.rn.f16x2 gives q * s + o, one rounding, in the instruction count of the zero-point path."""
    zl, zh = ("$11", "$12") if scaled else ("$9", "$10")
    consts = ""
    if offsets:                                       # z = 0: the pairs (1024, 1024) and (-64, -64)
        zl, zh = "c1024", "cm64"
        consts = ".reg .b32 c1024, cm64;\nmov.b32 c1024, 0x64006400;\nmov.b32 cm64, 0xD400D400;\n"
    op, o_lo, o_hi = ("fma", ", $11", ", $12") if offsets else ("mul", "", "")
    scale = (f"{op}.rn.f16x2 a0, a0, $9{o_lo};\n{op}.rn.f16x2 a2, a2, $9{o_lo};\n"
             f"{op}.rn.f16x2 a1, a1, $10{o_hi};\n{op}.rn.f16x2 a3, a3, $10{o_hi};\n") if scaled else ""
    return f"""
{{
.reg .b32 w1, a0, a1, a2, a3, k16;
{consts}mov.b32 k16, 0x2C002C00;
lop3.b32 a0, $8, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, $8, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 w1, $8, 8;
lop3.b32 a2, w1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a3, w1, 0x00F000F0, 0x64006400, 0xEA;
sub.rn.f16x2 a0, a0, {zl};
sub.rn.f16x2 a2, a2, {zl};
fma.rn.f16x2 a1, a1, k16, {zh};
fma.rn.f16x2 a3, a3, k16, {zh};
{scale}mov.b32 {{$0, $1}}, a0;
mov.b32 {{$2, $3}}, a1;
mov.b32 {{$4, $5}}, a2;
mov.b32 {{$6, $7}}, a3;
}}
"""


_FRAG_DQ_ASM = gl.constexpr(_frag_dq_asm(True))
_FRAG_DQ_UNSCALED_ASM = gl.constexpr(_frag_dq_asm(False))
_FRAG_DQ_OFFSETS_ASM = gl.constexpr(_frag_dq_asm(True, offsets=True))


@gluon.constexpr_function
def word_layout(num_warps, rn, rk):
    """Layout of the word tile [NG = 8 * num_warps * rn, RK, 4 (t), 4 (kt)]: lane = 4 g + t, warps and register
    repeats along the 16-row tiles, the 4 words of a 16-byte run (kt) in consecutive registers."""
    ng = 8 * num_warps * rn
    reg = [[0, 0, 0, 1], [0, 0, 0, 2]] + [[0, 1 << i, 0, 0] for i in range(rk.bit_length() - 1)] + \
          [[8 * num_warps << i, 0, 0, 0] for i in range(rn.bit_length() - 1)]
    lane = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warp = [[8 << i, 0, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [ng, rk, 4, 4])


@gluon.constexpr_function
def mma_layout(wgmma, num_warps, block_m):
    """The accumulator layout: mma.sync m16n8k16 (one warp per 16 rows of W^T), or Hopper's wgmma (a warpgroup per
    64 rows, x^T's BLOCK_M columns per instruction). Their A operand layouts are the same for 4 warps per 64 rows."""
    if wgmma:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])


@gluon.jit
def _frag_dequant(words, s_lo, s_hi, z_lo, z_hi, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  A_LAYOUT: gl.constexpr, SCALED: gl.constexpr = True, OFFSETS: gl.constexpr = False):
    """words int32 [NG, RK, 4, 4] -> the dequantized A tile fp16 [BLOCK_N, BLOCK_K] in the mma A layout
    (SCALED False: q - z, the scales ignored; OFFSETS: z_lo / z_hi are the offset pairs, q * s + o)."""
    if OFFSETS:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _FRAG_DQ_OFFSETS_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, s_lo, s_hi, z_lo, z_hi],
            dtype=[gl.float16] * 8, is_pure=True, pack=1)
    elif SCALED:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _FRAG_DQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, s_lo, s_hi, z_lo, z_hi],
            dtype=[gl.float16] * 8, is_pure=True, pack=1)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = gl.inline_asm_elementwise(
            _FRAG_DQ_UNSCALED_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, z_lo, z_hi],
            dtype=[gl.float16] * 8, is_pure=True, pack=1)
    return _frag_tile(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K, A_LAYOUT)


@gluon.jit
def _frag_tile(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               A_LAYOUT: gl.constexpr):
    """A word's 8 dequantized values by index b0 + 2 b1 + 4 b2 ([NG, RK, 4, 4] each) -> the A tile fp16
    [BLOCK_N, BLOCK_K] in the mma A layout (a trivial conversion: the values are already where the MMA reads them)."""
    # join appends its new dim last: values (b0, b1, b2) -> dims [..., b0, b1, b2]
    t = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
    NG: gl.constexpr = BLOCK_N // 2
    RK: gl.constexpr = BLOCK_K // 64
    t = gl.reshape(t, [NG // 8, 8, RK, 4, 4, 2, 2, 2])            # nt, g, kh, t, kt, b0, b1, b2
    t = gl.permute(t, [0, 6, 1, 2, 4, 7, 3, 5])                    # nt, b1, g, kh, kt, b2, t, b0
    t = gl.reshape(t, [BLOCK_N, BLOCK_K])
    return gl.convert_layout(t, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP: gl.constexpr,
               ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr, SCALES: gl.constexpr = True):
    """The weight loads of the step starting at row k0: words, the scales (SCALES) and packed zero words of rows
    g and g + 8 (raw: converted at use, so nothing waits for them here)."""
    if EVEN_N:
        words = gl.load(w_ptr + offs + k0 * 2)
    else:
        words = gl.load(w_ptr + offs + k0 * 2, mask=w_mask, other=0)
    s_lo, s_hi, z_lo, z_hi = _load_group(k0, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP, ZP_MODE,
                                         SCALES)
    if ZP_MODE == 4:
        z_lo = _q6_hi_load(z_ptr, offs, w_mask, k0, EVEN_N)
    elif ZP_MODE == 5:
        z_lo = _q5_hi_load(z_ptr, offs, w_mask, k0, EVEN_N)
    return words, s_lo, s_hi, z_lo, z_hi


@gluon.jit
def _load_group(k0, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP: gl.constexpr,
                ZP_MODE: gl.constexpr, SCALES: gl.constexpr = True):
    """The scales (SCALES) and packed zero words of rows g and g + 8 for the step starting at row k0 (ZP_MODE
    ZP_OFFSETS: their float offsets, loaded as the scales are). Groups of 32 span two 16-row words: each constant
    is loaded (and converted, _dequant_step) once for the pair, [NG, RK, 1, 2], and widened to the words after."""
    # k0 is a multiple of the group wherever k_in is not 0 (steps line up with the groups): the per-thread part of
    # each offset is loop-invariant and a step adds one scalar
    g0 = k0 // GROUP
    g_in = k_in // GROUP
    if SCALES or ZP_MODE == 3:           # k-quant: raw int16 sub-codes (and int32 d | dmin below), converted at use
        s_lo = gl.load(s_ptr + g0 * stride_sg + _group_offsets(g_in * stride_sg + n_lo, GROUP))
        s_hi = gl.load(s_ptr + g0 * stride_sg + _group_offsets(g_in * stride_sg + n_hi, GROUP))
    else:
        s_lo = 0
        s_hi = 0
    if ZP_MODE == 3:
        # super-blocks of 256 rows: one a step for steps of at most 256 rows (k_in [1, BLOCK_K / 64, 1, 4])
        sup = k0 // (8 * GROUP) if k_in.shape[1] <= 4 else (k0 + k_in) // (8 * GROUP)
        z_lo = gl.load(z_ptr + sup * stride_zg + _group_offsets(k_in * 0 + n_lo, GROUP))
        z_hi = gl.load(z_ptr + sup * stride_zg + _group_offsets(k_in * 0 + n_hi, GROUP))
    elif ZP_MODE == 4 or ZP_MODE == 5:    # Q6_K / Q5_K: their high-bit words come with the words (_load_step)
        z_lo = 0
        z_hi = 0
    elif ZP_MODE == 2:
        z_lo = gl.load(z_ptr + g0 * stride_zg + _group_offsets(g_in * stride_zg + n_lo, GROUP))
        z_hi = gl.load(z_ptr + g0 * stride_zg + _group_offsets(g_in * stride_zg + n_hi, GROUP))
    elif ZP_MODE:
        z_lo = gl.load(z_ptr + g0 * stride_zg + _group_offsets(g_in * stride_zg + n_lo // 8, GROUP))
        z_hi = gl.load(z_ptr + g0 * stride_zg + _group_offsets(g_in * stride_zg + n_hi // 8, GROUP))
    else:
        z_lo = 0
        z_hi = 0
    return s_lo, s_hi, z_lo, z_hi


@gluon.jit
def _group_offsets(offs, GROUP: gl.constexpr):
    """Offsets of a step's group constants by 16-row word [NG, RK, 1, 4] -> groups of 32 (two words a group): the
    even words' [NG, RK, 1, 2] (kt = 0, 2), so each constant is loaded and converted once (_by_word widens it)."""
    if GROUP == 32:
        offs = _even_words(offs)
    return offs


@gluon.jit
def _by_word(v, words):
    """A group constant of _group_offsets' pair shape [NG, RK, 1, 2] -> one a word, in the words' layout
    ([NG, RK, 1, 4]: kt = 2 j + i holds pair j's); a constant already by word, by step or scalar passes through."""
    if v.shape[3] == 2:
        v = gl.reshape(gl.join(v, v), [v.shape[0], v.shape[1], v.shape[2], 4])
        v = gl.convert_layout(v, words.type.layout, assert_trivial=True)
    return v


@gluon.jit
def _scale_pair(s):
    """fp16 scale -> the int32 bits of the fp16 pair (s, s) (one byte permute)."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [s], dtype=gl.int32, is_pure=True, pack=1)


# Q4_K's group constants without a conversion instruction (those run at 1/4 rate or less on sm80 / sm90, and a
# word's 8 weights would need 12 of them): one byte permute makes the codes the fp16 pair (1024 + sc, 1024 + m),
# one sub leaves (sc, m) exact, one mul.rn.f16x2 with the super-scale pair (d, dmin) rounds each exact product
# d * sc, dmin * m once to fp16 (as the fp32 product rounded to fp16 would be), and byte permutes spread (s, s) and
# (-o, -o): 6 instructions a pair of constants.
_KQ_PAIRS_ASM = gl.constexpr("""
{
.reg .b32 t, p, c;
mov.b32 c, 0x64646464;
prmt.b32 t, $2, c, 0x4140;
mov.b32 c, 0x64006400;
sub.rn.f16x2 t, t, c;
mul.rn.f16x2 t, t, $3;
prmt.b32 $0, t, t, 0x1010;
xor.b32 p, t, 0x80000000;
prmt.b32 $1, p, p, 0x3232;
}
""")


@gluon.jit
def _kquant_pair(sm, dd):
    """Q4_K's int16 sub-codes (sc | m << 8) and int32 d | dmin << 16 bits -> the int32 bits of the fp16 pairs
    (s, s) and (o, o): s = d * sc, o = -dmin * m, each rounded once to fp16."""
    codes = sm.to(gl.uint16, bitcast=True).to(gl.int32)        # zero-extended: the permute reads two bytes
    s_pair, o_pair = gl.inline_asm_elementwise(_KQ_PAIRS_ASM, "=r,=r,r,r", [codes, dd], dtype=[gl.int32, gl.int32],
                                               is_pure=True, pack=1)
    return s_pair, o_pair


@gluon.jit
def _zero(zw, rows, ZP_MODE: gl.constexpr):
    """Zero point of columns `rows` from their packed word (symmetric: 8)."""
    if ZP_MODE:
        z = (zw >> ((rows % 8) * 4)) & 0xF
    else:
        z = rows * 0 + 8
    return z


@gluon.jit
def swiglu_tile(pid_n, local, N, BLOCK_N: gl.constexpr):
    """The 16-row weight tile of a SwiGLU program's local tile `local`: gate tiles of pid_n's BLOCK_N / 2 output
    columns, then their up tiles N / 2 further on."""
    HALF: gl.constexpr = BLOCK_N // 32
    return pid_n * HALF + local % HALF + (local // HALF) * (N // 32)


@gluon.jit
def _tile_words(pid_n, N, KP, GROUP: gl.constexpr, EVEN_N: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, num_warps: gl.constexpr, SWIGLU: gl.constexpr = False):
    """Offsets of a [BLOCK_N, BLOCK_K] tile's words (step 0 of pid_n's columns), their mask, the columns of rows
    g and g + 8 (clamped into N) and each word's row offset inside a step where the scale group can change there.
    SWIGLU: the tile's first half is gate columns, its second half the same columns' up (N / 2 further on):
    16-row tiles nt = tile_n(r // 16) (`swiglu_tile`)."""
    WL: gl.constexpr = word_layout(num_warps, BLOCK_N // (16 * num_warps), BLOCK_K // 64)
    L3: gl.constexpr = gl.SliceLayout(3, WL)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ng = gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, L2))                # 8 nt + g
    nt = swiglu_tile(pid_n, ng // 8, N, BLOCK_N) if SWIGLU else pid_n * (BLOCK_N // 16) + ng // 8
    kh = gl.arange(0, BLOCK_K // 64, layout=gl.SliceLayout(0, L2))
    tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    kt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    nt4 = nt[:, None, None, None]
    # word offsets: ((nt * KP/64 + kb) * 32 + 4 g + t) * 4 + kt
    offs = (nt4 * (KP * 2) + ((ng % 8) * 16)[:, None, None, None] + (kh * 128)[None, :, None, None]
            + (tt * 4)[None, None, :, None] + kt[None, None, None, :])
    n_lo = (nt * 16 + ng % 8)[:, None, None, None]
    # the scale group changes per step (GROUP >= BLOCK_K), per 64-row block, or per 16-row word
    k_in = kh[None, :, None, None] * 64 if GROUP < BLOCK_K else 0
    k_in = k_in + kt[None, None, None, :] * 16 if GROUP < 64 else k_in
    if EVEN_N:
        n_hi = n_lo + 8
    else:
        n_hi = gl.minimum(n_lo + 8, N - 1)
        n_lo = gl.minimum(n_lo, N - 1)
    return offs, nt4 < N // 16, n_lo, n_hi, k_in


@gluon.jit
def _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, ZP_MODE: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, A_LAYOUT: gl.constexpr, SCALED: gl.constexpr = True):
    """A step's raw loads (_load_step) -> its dequantized A tile fp16 [BLOCK_N, BLOCK_K] (SCALED False: q - z).
    ZP_MODE: 0 symmetric (z = 8), 1 packed int4 zero points, 2 float offsets (scaled only: q * s + o), 3 k-quant
    two-level scales (scaled only; s and o formed in fp32, then fp16 for the f16x2 fma), 4 Q6_K's 6-bit codes
    (frag6.py; scaled only), 5 Q5_K's 5-bit codes with fp16 (s, o) pairs (frag5.py; scaled only)."""
    if ZP_MODE == 5:
        gl.static_assert(SCALED, "Q5_K's offsets need the scales applied to each weight (groups of 32)")
        s_lo, o_lo = _q5_pairs(s_lo)
        s_hi, o_hi = _q5_pairs(s_hi)
        v0, v1, v2, v3, v4, v5, v6, v7 = _q5_dequant(words, _q5_by_word(z_lo, words), _by_word(s_lo, words),
                                                     _by_word(s_hi, words), _by_word(o_lo, words),
                                                     _by_word(o_hi, words))
        a = _frag_tile(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K, A_LAYOUT)
    elif ZP_MODE == 4:
        gl.static_assert(SCALED, "Q6_K's scales are applied to each weight (groups of 16)")
        v0, v1, v2, v3, v4, v5, v6, v7 = _q6_dequant(words, _q6_by_word(z_lo, words), _scale_pair(s_lo),
                                                     _scale_pair(s_hi))
        a = _frag_tile(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K, A_LAYOUT)
    elif ZP_MODE == 3:
        gl.static_assert(SCALED, "k-quant scales need the scales applied to each weight (no SCALE_AFTER)")
        s_lo, z_lo = _kquant_pair(s_lo, z_lo)
        s_hi, z_hi = _kquant_pair(s_hi, z_hi)
        a = _frag_dequant(words, _by_word(s_lo, words), _by_word(s_hi, words), _by_word(z_lo, words),
                          _by_word(z_hi, words), BLOCK_N, BLOCK_K, A_LAYOUT, True, True)
    elif ZP_MODE == 2:
        gl.static_assert(SCALED, "float offsets need the scales applied to each weight (no SCALE_AFTER)")
        a = _frag_dequant(words, _by_word(_scale_pair(s_lo), words), _by_word(_scale_pair(s_hi), words),
                          _by_word(_scale_pair(z_lo), words), _by_word(_scale_pair(z_hi), words), BLOCK_N,
                          BLOCK_K, A_LAYOUT, True, True)
    else:
        if ZP_MODE:                                   # packed words: widened first (the shift is by column)
            z_lo = _by_word(z_lo, words)
            z_hi = _by_word(z_hi, words)
        z_lo_pair = 0x64006400 + _zero(z_lo, n_lo, ZP_MODE) * 0x10001                # (1024 + z) pairs
        z_hi_pair = (0xD400D400 - (1 << 32)) + _zero(z_hi, n_hi, ZP_MODE) * 0x100010  # -(64 + z) pairs
        if SCALED:
            a = _frag_dequant(words, _by_word(_scale_pair(s_lo), words), _by_word(_scale_pair(s_hi), words),
                              z_lo_pair, z_hi_pair, BLOCK_N, BLOCK_K, A_LAYOUT)
        else:
            a = _frag_dequant(words, 0, 0, z_lo_pair, z_hi_pair, BLOCK_N, BLOCK_K, A_LAYOUT, False)
    return a


@gluon.jit
def _frag_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KP, stride_sg, stride_zg, GROUP: gl.constexpr,
                         ZP_MODE: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         num_warps: gl.constexpr):
    """out = W^T [N, K] fp16 (the dense weight, rows = output columns) for the large-M path (then cuBLAS)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OUT_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    pid_n = gl.program_id(0)
    k0 = gl.program_id(1) * BLOCK_K
    offs, w_mask, n_lo, n_hi, k_in = _tile_words(pid_n, N, KP, GROUP, False, BLOCK_N, BLOCK_K, num_warps)
    words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, stride_sg,
                                               stride_zg, GROUP, ZP_MODE, False)
    a = _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L)
    a = gl.convert_layout(a, OUT_L)                              # coalesced 16-byte stores along K
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT_L))
    ok = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, OUT_L))
    gl.store(out_ptr + on[:, None] * K + ok[None, :], a, mask=(on < N)[:, None] & (ok < K)[None, :])


def frag_dequantize(fw: FragWeights, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """FragWeights -> W^T fp16 [N, K] (one rounding of (q - z) * s or q * s + o, as every W4A16 path)."""
    n, k = fw.out_features, fw.in_features
    kp = fw.words.shape[1] // 2
    group = fw.group_size if fw.scales.shape[0] > 1 else 0
    bk = pick_block_k(kp, group, block_k)
    out = torch.empty((n, k), dtype=torch.float16, device=fw.words.device)
    zeros, stride_zg = fw.zero_args()
    _frag_dequant_kernel[(triton.cdiv(n, block_n), kp // bk)](
        fw.words, fw.scales, zeros, out, n, k, kp, fw.scales.stride(0), stride_zg, GROUP=group or (1 << 30),
        ZP_MODE=fw.zp_mode, BLOCK_N=block_n, BLOCK_K=bk, num_warps=4)
    return out
