"""GGUF Q5_K in the fragment layout, read by the W4A16 tensor-core kernels (mma.py) as one more zero-point mode
(ZP_Q5): the 5-bit code q = lo + 16 hi (W = q * s + o, s and o per 32 weights) is split into

  words   int32 [N/16, Kp/64 * 128]   frag_words of the low 4 bits: exactly an INT4 layer's words
  hi      int32 [N/16, Kp/64 * 32]    the top bits of a thread's four consecutive words (kt = 0..3) in one int32:
                                      word 0's at frag6's bit positions (_HI_POS), word 2's one bit above them, words
                                      1 and 3 as 0 and 2 rotated left by 8 (so one shift and one rotate put each
                                      word's bits where frag6's LOP3 ORs them in)
  scales  int32 [K/32, N]             the fp16 pair (s, o) of each group: s = d * sc and o = -dmin * m, each exact
                                      product rounded once to fp16 (as the Q4_K fragment path rounds them)

One load and two byte permutes give a group's (s, s) and (o, o) pairs, against six instructions for Q4_K's
two-level codes; a word costs frag6's 18 instructions (the odd nibbles' fma takes -64 where Q6_K's takes -96, the
scale is an fma with the offset). Bits a weight: 4 + 1 + 32 / 32 = 6 (the planes of kernels/matmul/planes/q5k.py: 5.625,
which stay the CPU path, the bf16 path and the bit-exact reference). The dequantized weight is fp16(q * s + o) with
s and o in fp16: the Q4_K fragment path's roundings.
"""
import torch

from quant_serve.kernels.triton_compat import gl, gluon
from quant_serve.kernels.matmul.frag.layout import FragWeights, frag_codes, frag_words
from quant_serve.kernels.matmul.frag.q6k import _HI_POS, _even_words, _q6_by_word, _rotl8, _rotr8, hi_dq_asm
from quant_serve.kernels.matmul.frag.kquant import kquant_scales_offsets

_HI_BIT_MASK = sum(1 << pos for pos in _HI_POS.values())      # word 0's bits (words 2: << 1, 1 and 3: rotated)


def q5k_pairs(sub_codes: torch.Tensor, superscales: torch.Tensor) -> torch.Tensor:
    """Q4_K-style two-level codes [K/32, N] / [K/256, N] -> int32 [K/32, N]: fp16 s in the low half, fp16 o in the
    high half (each fp32 product of gguf's dequantize rounded once to fp16)."""
    s, o = kquant_scales_offsets(sub_codes, superscales)
    bits = lambda v: v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    return (bits(s) | (bits(o) << 16)).contiguous()


def pair_scales_offsets(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (s, o) pairs -> (s, o) fp16."""
    lo = (pairs & 0xFFFF).to(torch.int16)
    hi = ((pairs >> 16) & 0xFFFF).to(torch.int16)
    return lo.view(torch.float16), hi.view(torch.float16)


def pack_frag5(codes: torch.Tensor, pairs: torch.Tensor) -> FragWeights:
    """codes int [K, N] in 0..31 (Q5_K's q), pairs int32 [K/32, N] (q5k_pairs) -> FragWeights (ZP_Q5), on the codes'
    device. K must be a multiple of 64 (a Q5_K file's rows are whole 256-row super-blocks)."""
    k, n = codes.shape
    if n % 16 or k % 64:
        raise ValueError(f"the Q5_K fragment layout needs N a multiple of 16 and K of 64, got K = {k}, N = {n}")
    if tuple(pairs.shape) != (k // 32, n) or pairs.dtype != torch.int32:
        raise ValueError(f"Q5_K fragment pairs must be int32 [{k // 32}, {n}], got {pairs.dtype} "
                         f"{tuple(pairs.shape)}")
    u = codes.to(torch.int32)
    words = frag_words(u & 0xF)
    high = frag_words(u >> 4)                                                     # 1-bit values in the nibbles
    h = torch.zeros_like(high)
    for j, pos in _HI_POS.items():
        h |= ((high >> (4 * j)) & 1) << pos
    h = h.view(n // 16, -1, 4)                                                    # a thread's kt = 0..3
    hi = (h[..., 0] | _rotl8(h[..., 1]) | (h[..., 2] << 1) | _rotl8(h[..., 3] << 1)).contiguous()
    return FragWeights(words, pairs.contiguous(), None, 32, k, n, hi=hi)


def frag5_codes(fw: FragWeights) -> torch.Tensor:
    """pack_frag5's inverse on the codes: -> int32 [K, N] in 0..31."""
    views = [fw.hi, _rotr8(fw.hi), (fw.hi >> 1) & 0x7FFFFFFF, _rotr8((fw.hi >> 1) & 0x7FFFFFFF)]
    h = torch.stack([v & _HI_BIT_MASK for v in views], dim=-1).view(fw.hi.shape[0], -1)
    high = torch.zeros_like(h)
    for j, pos in _HI_POS.items():
        high |= ((h >> pos) & 1) << (4 * j)
    return (frag_codes(fw.words) | (frag_codes(high) << 4))[: fw.in_features]


def frag5_dequantize_ref(fw: FragWeights) -> torch.Tensor:
    """-> fp16 W [K, N] as the kernels form it: q * s + o with s, o fp16, one rounding."""
    s, o = pair_scales_offsets(fw.scales)
    s, o = (v.double().repeat_interleave(32, dim=0)[: fw.in_features] for v in (s, o))
    return (frag5_codes(fw).double() * s + o).to(torch.float16)


def frag5_bytes(k: int, n: int) -> int:
    """Bytes a Q5_K matrix [K, N] takes in this layout (K padded to 64)."""
    kp = -(-k // 64) * 64
    return kp * n * 5 // 8 + -(-k // 32) * n * 4


@gluon.jit
def _q5_hi_load(z_ptr, offs, w_mask, k0, EVEN_N: gl.constexpr):
    """The step's high-bit words: one int32 for each four words of the tile, [NG, RK, 4, 1] (kt = 0's offsets
    quartered: a step of k0 rows moves them k0 / 2)."""
    quads = _first_words(offs) // 4
    if EVEN_N:
        h = gl.load(z_ptr + quads + k0 // 2)
    else:
        h = gl.load(z_ptr + quads + k0 // 2, mask=_first_words(w_mask & (offs >= 0)), other=0)
    return h


@gluon.jit
def _first_words(v):
    """[NG, RK, T, 4] by 16-row word -> [NG, RK, T, 1]: the first word's (kt = 0)."""
    even = _even_words(v)
    first, third = gl.split(gl.reshape(even, [v.shape[0], v.shape[1], v.shape[2], 1, 2]))
    return first


@gluon.jit
def _q5_by_word(h, words):
    """[NG, RK, 4, 1] high-bit words -> one a word in the words' layout: words 0 / 1 read h as stored / rotated right
    by 8, words 2 / 3 the same after a shift right by 1."""
    shifted = gl.inline_asm_elementwise("shr.u32 $0, $1, 1;", "=r,r", [h], dtype=gl.int32, is_pure=True, pack=1)
    pairs = gl.reshape(gl.join(h, shifted), [h.shape[0], h.shape[1], h.shape[2], 2])
    return _q6_by_word(pairs, words)


# a group's (s | o << 16) bits -> the pairs (s, s) and (o, o)
_Q5_PAIRS_ASM = gl.constexpr("prmt.b32 $0, $2, $2, 0x1010;\nprmt.b32 $1, $2, $2, 0x3232;")


@gluon.jit
def _q5_pairs(p):
    return gl.inline_asm_elementwise(_Q5_PAIRS_ASM, "=r,=r,r", [p], dtype=[gl.int32, gl.int32], is_pure=True, pack=1)


_Q5_DQ_ASM = gl.constexpr(hi_dq_asm(5))


@gluon.jit
def _q5_dequant(words, hi, s_lo, s_hi, o_lo, o_hi):
    """A step's words, their high bits (by word) and (s, s) / (o, o) pairs -> the 8 fp16 values of each word
    q * s + o, in _frag_dequant's order: 1024 + q (16 (1024 + q) for the odd nibbles) comes out of the LOP3s exact,
    one sub (fma) takes it to q, one fma to q * s + o."""
    return gl.inline_asm_elementwise(_Q5_DQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r",
                                     [words, hi, s_lo, s_hi, o_lo, o_hi], dtype=[gl.float16] * 8, is_pure=True,
                                     pack=1)
