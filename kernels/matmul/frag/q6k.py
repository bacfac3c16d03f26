"""GGUF Q6_K in the fragment layout, read by the W4A16 tensor-core kernels (mma.py) as one more zero-point mode
(ZP_Q6): the 6-bit code u = lo + 16 hi (W = (u - 32) * s, s per 16 weights) is split into

  words   int32 [N/16, Kp/64 * 128]   frag_words of the low 4 bits: exactly an INT4 layer's words
  hi      int32 [N/16, Kp/64 * 64]    the top 2 bits of two neighbouring words (kt = 2j, 2j + 1 of frag_words) in one
                                      int32: word 2j's at the bit positions _HI_POS by nibble j, word 2j + 1's rotated
                                      left by 8 into the bits between (so a rotate right by 8 puts them in place)
  scales  fp16 [Kp/16, N]             s = d * sc rounded once to fp16 (the fragment kernels' fma is f16x2)

Each nibble's 2 high bits sit two bits above where Marlin's LOP3 extraction leaves that nibble, so one more LOP3
ORs them in and the fp16 pair holds 1024 + u (16 (1024 + u) for the odd nibbles) exactly: 18 instructions a word of
8 weights with the scale, against ~90 in the W8A16 plane GEMV (kernels/matmul/planes/q6k.py). Bits a weight: 4 + 2 + 1 = 7
(the planes: 6.5625). The dequantized weight is fp16((u - 32) * fp16(d * sc)): two roundings, as the Q4_K fragment
path has; the plane kernels stay the CPU path and the bit-exact reference.
"""
import torch

from quant_serve.kernels.triton_compat import gl, gluon
from quant_serve.kernels.matmul.frag.layout import FragWeights, frag_codes, frag_words

# nibble j of a word -> bit of its 2 high bits (j = 0, 4: a0's halves; 1, 5: a1's; 2, 6 and 3, 7: a2's and a3's
# after the word's shift by 8, and these bits' by 2)
_HI_POS = {0: 4, 4: 20, 1: 8, 5: 24, 2: 6, 6: 22, 3: 10, 7: 26}
_HI_MASK = 0x0FF00FF0


def _rotl8(v: torch.Tensor) -> torch.Tensor:
    return (v << 8) | ((v >> 24) & 0xFF)


def _rotr8(v: torch.Tensor) -> torch.Tensor:
    return ((v >> 8) & 0x00FFFFFF) | (v << 24)


def pack_frag6(codes: torch.Tensor, scales: torch.Tensor) -> FragWeights:
    """codes int [K, N] in -32..31 (Q6_K's u - 32), scales [K/16, N] (d * sc) -> FragWeights (ZP_Q6), on the codes'
    device. K is padded to a multiple of 64 with code 0 and scale 0."""
    k, n = codes.shape
    if n % 16 or k % 16:
        raise ValueError(f"the Q6_K fragment layout needs K and N multiples of 16, got K = {k}, N = {n}")
    if tuple(scales.shape) != (k // 16, n):
        raise ValueError(f"Q6_K fragment scales must be [{k // 16}, {n}], got {tuple(scales.shape)}")
    kp = -(-k // 64) * 64
    u = (codes.to(torch.int32) + 32)
    if kp > k:
        u = torch.cat([u, u.new_full((kp - k, n), 32)])
        scales = torch.cat([scales, scales.new_zeros((kp - k) // 16, n)])
    words = frag_words(u & 0xF)
    high = frag_words(u >> 4)                                                     # 2-bit values in the nibbles
    h = torch.zeros_like(high)
    for j, pos in _HI_POS.items():
        h |= ((high >> (4 * j)) & 3) << pos
    h = h.view(n // 16, -1, 2)                                                    # kt pairs (kt is fastest)
    hi = (h[..., 0] | _rotl8(h[..., 1])).contiguous()
    return FragWeights(words, scales.to(torch.float16).contiguous(), None, 16, k, n, hi=hi)


def frag6_codes(fw: FragWeights) -> torch.Tensor:
    """pack_frag6's inverse on the codes: -> int32 [K, N] in -32..31."""
    even, odd = fw.hi & _HI_MASK, _rotr8(fw.hi) & _HI_MASK
    h = torch.stack([even, odd], dim=-1).view(fw.hi.shape[0], -1)
    high = torch.zeros_like(h)
    for j, pos in _HI_POS.items():
        high |= ((h >> pos) & 3) << (4 * j)
    u = frag_codes(fw.words) | (frag_codes(high) << 4)
    return u[: fw.in_features] - 32


def frag6_dequantize_ref(fw: FragWeights) -> torch.Tensor:
    """-> fp16 W [K, N] as the kernels form it: (u - 32) * s, one fp16 rounding of the exact product."""
    s = fw.scales[: fw.in_features // 16].repeat_interleave(16, dim=0)
    return (frag6_codes(fw).float() * s.float()).to(torch.float16)


def frag6_bytes(k: int, n: int) -> int:
    """Bytes a Q6_K matrix [K, N] takes in this layout (K padded to 64)."""
    kp = -(-k // 64) * 64
    return kp * n * 3 // 4 + kp // 16 * n * 2


@gluon.jit
def _even_words(v):
    """[NG, RK, T, 4] by 16-row word -> [NG, RK, T, 2]: the even words' (kt = 0, 2)."""
    even, odd = gl.split(gl.reshape(v, [v.shape[0], v.shape[1], v.shape[2], 2, 2]))
    return even


@gluon.jit
def _q6_hi_load(z_ptr, offs, w_mask, k0, EVEN_N: gl.constexpr):
    """The step's high-bit words: one int32 for each two words of the tile, [NG, RK, 4, 2] (the words' offsets
    halved: a step of k0 rows moves them k0)."""
    pairs = _even_words(offs) // 2
    if EVEN_N:
        h = gl.load(z_ptr + pairs + k0)
    else:
        h = gl.load(z_ptr + pairs + k0, mask=_even_words(w_mask & (offs >= 0)), other=0)
    return h


@gluon.jit
def _q6_by_word(h, words):
    """[NG, RK, 4, 2] high-bit words -> one a word in the words' layout: word 2j reads pair j as stored, word
    2j + 1 rotated right by 8."""
    odd = gl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $1, 8;", "=r,r", [h], dtype=gl.int32, is_pure=True,
                                    pack=1)
    v = gl.reshape(gl.join(h, odd), [h.shape[0], h.shape[1], h.shape[2], 4])
    return gl.convert_layout(v, words.type.layout, assert_trivial=True)


def hi_dq_asm(bits: int) -> str:
    """The dequant of one word with its high bits (view $9, by word) beside it, outputs as _frag_dq_asm's. bits 6
    (Q6_K): 2 high bits a nibble, u - 32 times the scale pairs $10 (row g) and $11 (row g + 8); bits 5 (Q5_K,
    frag5.py): 1 high bit, q * s + o with the offset pairs $12 and $13. The even nibbles come out 1024 + u, the odd
    ones 16 (1024 + u) (exact), so one sub and one fma (with 1/16) take them to u - z, and one mul or fma scales."""
    lo, hi = ("0x00300030", "0x03000300") if bits == 6 else ("0x00100010", "0x01000100")
    z_even, z_odd = ("0x64206420", "0xD600D600") if bits == 6 else ("0x64006400", "0xD400D400")   # 1024 + z, -(64 + z)
    op, o_lo, o_hi = ("mul", "", "") if bits == 6 else ("fma", ", $12", ", $13")
    return f"""
{{
.reg .b32 w1, h1, t, a0, a1, a2, a3, c, k16, ze, zo;
mov.b32 c, 0x64006400;
mov.b32 k16, 0x2C002C00;
mov.b32 ze, {z_even};
mov.b32 zo, {z_odd};
lop3.b32 t, $9, {lo}, c, 0xEA;
lop3.b32 a0, $8, 0x000F000F, t, 0xEA;
lop3.b32 t, $9, {hi}, c, 0xEA;
lop3.b32 a1, $8, 0x00F000F0, t, 0xEA;
shr.u32 w1, $8, 8;
shr.u32 h1, $9, 2;
lop3.b32 t, h1, {lo}, c, 0xEA;
lop3.b32 a2, w1, 0x000F000F, t, 0xEA;
lop3.b32 t, h1, {hi}, c, 0xEA;
lop3.b32 a3, w1, 0x00F000F0, t, 0xEA;
sub.rn.f16x2 a0, a0, ze;
sub.rn.f16x2 a2, a2, ze;
fma.rn.f16x2 a1, a1, k16, zo;
fma.rn.f16x2 a3, a3, k16, zo;
{op}.rn.f16x2 a0, a0, $10{o_lo};
{op}.rn.f16x2 a2, a2, $10{o_lo};
{op}.rn.f16x2 a1, a1, $11{o_hi};
{op}.rn.f16x2 a3, a3, $11{o_hi};
mov.b32 {{$0, $1}}, a0;
mov.b32 {{$2, $3}}, a1;
mov.b32 {{$4, $5}}, a2;
mov.b32 {{$6, $7}}, a3;
}}
"""


_Q6_DQ_ASM = gl.constexpr(hi_dq_asm(6))


@gluon.jit
def _q6_dequant(words, hi, s_lo, s_hi):
    """A step's words, their high bits (by word) and scale pairs -> the 8 fp16 values of each word (u - 32) * s,
    in _frag_dequant's order: the odd nibbles come out 16 (1024 + u), exact, and one fma takes them to u - 32."""
    return gl.inline_asm_elementwise(_Q6_DQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r", [words, hi, s_lo, s_hi],
                                     dtype=[gl.float16] * 8, is_pure=True, pack=1)
