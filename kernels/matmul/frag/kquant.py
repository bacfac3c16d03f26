"""The two-level scales of GGUF's Q4_K kept as the file has them (no fp16 / fp32 per-group products), read by every
W4A16 kernel as one more zero-point mode (ZP_KQUANT in the fragment kernels, OFFSETS == 2 in the row-layout ones):

  sub_codes    int16 [G, N]        per 32 weights: the 6-bit sub-scale code sc (low byte) and sub-min code m (high
                                   byte), unpacked to a byte each at load
  superscales  int32 [G / 8, N]    per 256 weights: the fp16 bits of d (low half) and dmin (high half)
  W[k, n] = q * (f32(d) * sc) - f32(dmin) * m   (g = k // 32, super-block g // 8)

gguf.quants.dequantize computes the same fp32 products and the same fp32 q * s - o, so the row-layout kernels'
dequantized weights are bit-exact (the fragment kernels round s and o to fp16 for their f16x2 fma). Bytes per
weight: 4 bits + 16 / 32 + 32 / 256 = 4.625 bits (against 4 + 2 * 16 / 32 = 5 for fp16 scale + offset per 32).
"""
import torch

KQ_GROUP = 32          # weights per sub-scale
KQ_SUPER = 8           # sub-blocks per super-block (256 weights)


def pack_sub_codes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """sub-scale and sub-min codes 0..63, any int dtype [G, N] -> int16 [G, N] (sc | m << 8)."""
    return (sc.to(torch.int32) | (mn.to(torch.int32) << 8)).to(torch.int16)


def pack_superscales(d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """fp16 d, dmin [G / 8, N] -> int32 [G / 8, N] holding their bits (d low, dmin high)."""
    lo = d.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    hi = dmin.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return lo | (hi << 16)


def unpack_superscales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [G / 8, N] -> (d, dmin) fp32 [G / 8, N]."""
    d = (packed & 0xFFFF).to(torch.int16).view(torch.float16).float()
    dmin = ((packed >> 16) & 0xFFFF).to(torch.int16).view(torch.float16).float()
    return d, dmin


def kquant_scales_offsets(sub_codes: torch.Tensor, superscales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scales, offsets) fp32 [G, N], W = q * s + o: the exact products gguf.quants.dequantize forms."""
    check_kquant(sub_codes, superscales)
    d, dmin = unpack_superscales(superscales)
    g = sub_codes.shape[0]
    d = d.repeat_interleave(KQ_SUPER, dim=0)[:g]
    dmin = dmin.repeat_interleave(KQ_SUPER, dim=0)[:g]
    codes = sub_codes.to(torch.int32)
    return d * (codes & 0xFF).float(), -(dmin * ((codes >> 8) & 0xFF).float())


def merge_two_level(shards: list) -> torch.Tensor | None:
    """The super-scales of a merged layer's shards (objects with scales, offsets, superscales): concatenated
    along N [G/8, N] where every shard is Q4_K (the kernels read them), else None, and each Q4_K shard's scales and
    offsets become their fp32 products in place (merged with another INT4 type)."""
    if all(s.superscales is None for s in shards):
        return None
    if all(s.superscales is not None for s in shards):
        return torch.cat([s.superscales for s in shards], dim=1)
    for s in shards:
        if s.superscales is not None:
            s.scales, s.offsets = kquant_scales_offsets(s.scales, s.superscales)
            s.superscales = None
    return None


def check_kquant(sub_codes: torch.Tensor, superscales: torch.Tensor) -> None:
    if sub_codes.dtype != torch.int16 or superscales.dtype != torch.int32:
        raise ValueError(f"k-quant scales must be int16 sub-codes and int32 super-scales, got {sub_codes.dtype} "
                         f"and {superscales.dtype}")
    g, n = sub_codes.shape
    if tuple(superscales.shape) != (-(-g // KQ_SUPER), n):
        raise ValueError(f"k-quant super-scales {tuple(superscales.shape)} do not cover sub-codes {(g, n)} "
                         f"({KQ_SUPER} groups of {KQ_GROUP} per super-block)")


def kquant_bytes(k: int, n: int) -> int:
    """Bytes a Q4_K matrix [K, N] takes in this layout (codes, sub-codes, super-scales)."""
    return k * n // 2 + k // KQ_GROUP * n * 2 + -(-k // (KQ_GROUP * KQ_SUPER)) * n * 4
