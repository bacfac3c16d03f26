"""Gluon pieces of the W4A8 matmul (kernels/matmul/int8/mma.py): the int8 A tile formed in registers from fragment words,
and the offsets of a program's words when its warps also split the x rows (the A tile then broadcast to them).

A fragment word of lane 4g + t (kernels/matmul/frag/layout.py) holds nibble j = 4 b0 + 2 b2 + b1 = the code of row g + 8 b1,
k = 2t + b0 + 8 b2 of a 16 x 16 tile. `w & 0x0F0F0F0F` is then four int8 of row g and `(w >> 4) & 0x0F0F0F0F` the
same four k of row g + 8: byte i = 2 b0 + b2 holds k = 2t + b0 + 8 b2, so the pair is one half of an m16n8k32 A
fragment (rows g / g + 8, four k a register) in the K order x_q is stored in (kernels/matmul/int8/quant.py), and two words
of consecutive 16-row tiles make one k32 fragment.
"""
from quant_serve.kernels.triton_compat import gl, gluon
from quant_serve.kernels.matmul.frag.tiles import _zero

# bytes (q | 0x80) - z (no borrow: 0x80 + q > z), top bit flipped: q - z as int8, four a register; 3 instructions.
# $0 the output (four int8), $1..$4 four copies of the (shifted) word, $5..$8 of the row's z * 0x01010101
_A8_ASM = gl.constexpr("""
{
.reg .b32 t;
lop3.b32 t, $1, 0x0F0F0F0F, 0x80808080, 0xEA;
sub.u32 t, t, $5;
xor.b32 $0, t, 0x80808080;
}
""")


@gluon.constexpr_function
def a8_word_layout(warps_n, warps_m, rn, rk):
    """Layout of the word tile [NG = 8 * warps_n * rn, RK, 4 (t), 4 (kt)]: lane = 4 g + t, the 4 words of a 16-byte
    run (kt) in consecutive registers, then the 64-row blocks, then register repeats along the 16-row tiles; warps
    as the MMA layout's warps_per_cta [warps_n, warps_m] (the x-row warps, fastest, see the same words)."""
    ng = 8 * warps_n * rn
    reg = [[0, 0, 0, 1], [0, 0, 0, 2]] + [[0, 1 << i, 0, 0] for i in range(rk.bit_length() - 1)] + \
          [[8 * warps_n << i, 0, 0, 0] for i in range(rn.bit_length() - 1)]
    lane = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warp = [[0, 0, 0, 0] for _ in range(warps_m.bit_length() - 1)] + \
           [[8 << i, 0, 0, 0] for i in range(warps_n.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [ng, rk, 4, 4])


@gluon.jit
def _a8_tile_words(pid_n, N, KP, EVEN_N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   WARPS_N: gl.constexpr, WARPS_M: gl.constexpr):
    """Offsets of a [BLOCK_N, BLOCK_K] tile's words (step 0 of pid_n's columns), their mask and the columns of rows
    g and g + 8 (clamped into N), as frag_tiles._tile_words for steps inside one scale group."""
    WL: gl.constexpr = a8_word_layout(WARPS_N, WARPS_M, BLOCK_N // (16 * WARPS_N), BLOCK_K // 64)
    L3: gl.constexpr = gl.SliceLayout(3, WL)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ng = gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(1, L2))                # 8 nt + g
    nt = pid_n * (BLOCK_N // 16) + ng // 8
    kh = gl.arange(0, BLOCK_K // 64, layout=gl.SliceLayout(0, L2))
    tt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    kt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    nt4 = nt[:, None, None, None]
    # word offsets: ((nt * KP/64 + kb) * 32 + 4 g + t) * 4 + kt
    offs = (nt4 * (KP * 2) + ((ng % 8) * 16)[:, None, None, None] + (kh * 128)[None, :, None, None]
            + (tt * 4)[None, None, :, None] + kt[None, None, None, :])
    n_lo = (nt * 16 + ng % 8)[:, None, None, None]
    if EVEN_N:
        n_hi = n_lo + 8
    else:
        n_hi = gl.minimum(n_lo + 8, N - 1)
        n_lo = gl.minimum(n_lo, N - 1)
    return offs, nt4 < N // 16, n_lo, n_hi


@gluon.jit
def _x8(v):
    """[..., 2] -> [..., 8] in registers (e = 4 b + 2 j + j': four copies of each, the new dims fastest): pack=4
    hands an asm instance four consecutive values and takes back one register of four int8."""
    v = gl.join(v, v)
    v = gl.join(v, v)
    return gl.reshape(v, [v.shape[0], v.shape[1], v.shape[2], v.shape[3], 8])


@gluon.jit
def _zc(zw, rows, words, ZP_MODE: gl.constexpr):
    """The rows' zero points (packed words zw, symmetric: 8) as four bytes z * 0x01010101, in the words' shape."""
    return _zero(zw, rows, ZP_MODE) * 0x01010101 + gl.zeros_like(words)


@gluon.jit
def _a8_tile(words, zc_lo, zc_hi, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, A_LAYOUT: gl.constexpr):
    """words int32 [NG, RK, 4 (t), 4 (kt)] and the rows' z * 0x01010101 (g: zc_lo, g + 8: zc_hi, the words' shape)
    -> the int8 A tile [BLOCK_N, BLOCK_K] (q - z) in x_q's K order, in the MMA's A layout (a trivial conversion:
    the bytes are where mma.sync reads them)."""
    w = _x8(gl.join(words, words >> 4))                       # [NG, RK, 4, 4, 8]: byte e % 4 of row g + 8 (e // 4)
    z = _x8(gl.join(zc_lo, zc_hi))
    a = gl.inline_asm_elementwise(_A8_ASM, "=r,r,r,r,r,r,r,r,r", [w, z], dtype=gl.int8, is_pure=True, pack=4)
    NG: gl.constexpr = BLOCK_N // 2
    RK: gl.constexpr = BLOCK_K // 64
    a = gl.reshape(a, [NG // 8, 8, RK, 4, 2, 2, 2, 4])         # nt, g, kh, t, c, h, b1, i  (kt = 2c + h)
    a = gl.permute(a, [0, 6, 1, 2, 4, 5, 3, 7])                # nt, b1, g, kh, c, h, t, i
    a = gl.reshape(a, [BLOCK_N, BLOCK_K])                      # n = 16 nt + 8 b1 + g, p = 64 kh + 16 kt + 4 t + i
    return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)
