"""The fragment layout of INT4 weights (made once at load; read by the Gluon kernels in kernels/matmul/frag/mma.py).

Each int32 word holds the 8 codes one thread of an mma.m16n8k16 holds in one A fragment of W^T (rows = output
columns n, columns = input rows k): lane 4g + t of a 16 x 16 tile holds (n, k) = (g + 8 b1, 2t + b0 + 8 b2) in
nibble j = 4 b0 + 2 b2 + b1, so Marlin's LOP3 extraction of nibbles (j, j + 4) gives the fp16 pair of
consecutive k a fragment register holds. Words are stored [N/16, Kp/64, 32 lanes, 4 tiles of 16 k]: a warp's 16-byte
loads of one 16-row tile and 64 k are one contiguous 512-byte run, each 16-row tile one contiguous row of words.
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.matmul.reference import pack_int4_rows, unpack_int4_rows
from quant_serve.kernels.matmul.rows.layout import check_offsets

# the kernels' ZP_MODE: symmetric (z = 8), packed int4 zeros, float offsets, k-quant two-level scales (kquant.py),
# GGUF Q6_K's 6-bit codes (frag6.py: these words hold the low 4 bits, `hi` the top 2), GGUF Q5_K's 5-bit codes
# (frag5.py: `hi` the top bit, scales the fp16 (s, o) pairs as int32)
ZP_NONE, ZP_INT4, ZP_OFFSETS, ZP_KQUANT, ZP_Q6, ZP_Q5 = 0, 1, 2, 3, 4, 5


def frag_words(codes: torch.Tensor) -> torch.Tensor:
    """codes int [Kp, N] (Kp % 64 == 0, N % 16 == 0, natural order) -> int32 [N/16, Kp/64 * 128] fragment words:
    word ((nt, kb), lane 4g+t, kt) holds in nibble j = 4 b0 + 2 b2 + b1 the code of row
    k = 64 kb + 16 kt + 2 t + b0 + 8 b2, column n = 16 nt + g + 8 b1."""
    kp, n = codes.shape
    c = codes.to(torch.int32).view(kp // 64, 4, 2, 4, 2, n // 16, 2, 8)       # kb, kt, b2, t, b0, nt, b1, g
    c = c.permute(5, 0, 7, 3, 1, 4, 2, 6).reshape(n // 16, kp // 64 * 128, 8)  # nt, kb, g, t, kt | b0, b2, b1
    words = c[..., 0].clone()
    for j in range(1, 8):
        words |= c[..., j] << (4 * j)
    return words


def frag_codes(words: torch.Tensor) -> torch.Tensor:
    """frag_words' inverse: int32 [N/16, Kp/64 * 128] -> codes int32 [Kp, N]."""
    nt16, w = words.shape
    kb = w // 128
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    c = (words.unsqueeze(-1) >> shifts) & 0xF                                  # nt, (kb g t kt), j
    c = c.view(nt16, kb, 8, 4, 4, 2, 2, 2)                                     # nt, kb, g, t, kt, b0, b2, b1
    return c.permute(1, 4, 6, 3, 5, 0, 7, 2).reshape(kb * 64, nt16 * 16)


@dataclass
class FragWeights:
    """INT4 weights in the fragment layout: words int32 [N/16, Kp/64 * 128] (frag_words), scales [G, N],
    qzeros int32 [G, N/8] or None (symmetric, z = 8), group_size (K for one group), perm int64 [K] or None,
    offsets fp16 [G, N] or None (GGUF's float offsets, W = q * s + o; only with qzeros None)."""
    words: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int
    perm: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    superscales: torch.Tensor | None = None   # int32 [G/8, N] (Q4_K's d | dmin); scales are then int16 sub-codes
    hi: torch.Tensor | None = None            # int32 [N/16, Kp/64 * 64]: Q6_K's top 2 bits (frag6.py); Q5_K's
    #                                           top bit [N/16, Kp/64 * 32] with int32 (s, o) scales (frag5.py)
    # this layer's activation choice where it differs from KernelOptions.activation_dtype: "fp16" where its weight
    # format has not met the int8 accuracy gate (quant/activations.py), None: the runtime's options
    activation_dtype: str | None = None

    @property
    def zp_mode(self) -> int:
        """The kernels' ZP_MODE constexpr: ZP_Q5, ZP_Q6, ZP_KQUANT, ZP_OFFSETS, ZP_INT4 or ZP_NONE."""
        if self.hi is not None:
            return ZP_Q5 if self.scales.dtype == torch.int32 else ZP_Q6
        if self.superscales is not None:
            return ZP_KQUANT
        return ZP_OFFSETS if self.offsets is not None else ZP_INT4 if self.qzeros is not None else ZP_NONE

    def zero_args(self) -> tuple[torch.Tensor, int]:
        """The kernels' zero-point pointer and its group stride: the offsets [G, N], the packed zeros [G, N/8], or
        the words (never read) and 0; k-quant: the super-scales [G/8, N]; Q6_K / Q5_K: their high-bit words (read
        by word)."""
        if self.hi is not None:
            return self.hi, 0
        if self.superscales is not None:
            return self.superscales, self.superscales.stride(0)
        if self.offsets is not None:
            return self.offsets, self.offsets.stride(0)
        if self.qzeros is not None:
            return self.qzeros, self.qzeros.stride(0)
        return self.words, 0


def prepare_frag(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
                 perm: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 superscales: torch.Tensor | None = None) -> FragWeights:
    """Standard internal layout (kernels/matmul/reference.py) -> FragWeights, once at load on the weights' device.
    offsets are cast to the scales' dtype (fp16: the kernels dequantize with one fp16 fma, q * s + o); a loader
    with fp32 scales / offsets (Q4_K) casts its scales to fp16 first, as for any checkpoint."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if n % 16:
        raise ValueError(f"the fragment layout needs out_features % 16 == 0, got {n}")
    if 0 < group_size < k and group_size % 16:
        raise ValueError(f"the fragment layout needs a group size that is a multiple of 16, got {group_size}")
    check_offsets(offsets, scales, qzeros, superscales)
    kp = -(-k // 64) * 64
    codes = unpack_int4_rows(qweight)
    codes = torch.cat([codes, codes.new_zeros(kp - k, n)]) if kp > k else codes
    gs = k if group_size <= 0 else group_size
    return FragWeights(frag_words(codes), scales.contiguous(), None if qzeros is None else qzeros.contiguous(),
                       gs, k, n, None if perm is None else perm.to(torch.long),
                       None if offsets is None else offsets.to(scales.dtype).contiguous(),
                       None if superscales is None else superscales.contiguous())


def frag_standard(fw: FragWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """FragWeights -> (qweight [K/8, N], scales, qzeros, group_size) in the standard layout (the twin's input)."""
    return pack_int4_rows(frag_codes(fw.words)[: fw.in_features]), fw.scales, fw.qzeros, fw.group_size


def pick_block_k(kp: int, group_size: int, block_k: int) -> int:
    """The largest of block_k, 128, 64 that divides Kp and whose steps line up with the scale groups
    (group_size 0: one group)."""
    for bk in (block_k, 128, 64):
        if bk <= block_k and kp % bk == 0 and (not group_size or group_size % bk == 0 or bk % group_size == 0):
            return bk
    raise ValueError(f"group size {group_size} does not line up with 64-row steps")
