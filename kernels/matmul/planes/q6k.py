"""GGUF Q6_K kept at 6 bits in the W8A16 kernels: codes in two bit planes plus the file's two-level scales, read by
the same GEMV and dequantize kernels (kernels.py, the Q6 constexpr) instead of int8 codes and a float scale per 16.

  planes       uint8 [K/2 + K/4, N]   per 64-row chunk c of K: low plane row 32 c + j holds the low 4 bits of
                                      rows 64 c + j (low nibble) and 64 c + 32 + j (high nibble); high plane row
                                      K/2 + 16 c + j holds the top 2 bits of rows 64 c + 16 t + j in bits 2t, 2t + 1
  sub_scales   int8 [K/16, N]         the file's 8-bit sub-scales, one per 16 weights
  d            fp16 [K/256, N]        the super-block scale
  W[k, n] = (f32(d) * sc) * (u - 32), u the 6-bit code: gguf.quants.dequantize's fp32 products, so the dequant is
  bit-exact. Bits a weight: 4 + 2 + 8 / 16 + 16 / 256 = 6.5625 (against 8 + 16 / 16 = 9 for int8 codes and an
  fp16 scale per 16).
"""
from dataclasses import dataclass

import torch

Q6_CHUNK = 64          # rows per plane chunk (the kernels' BLOCK_K is a multiple of it)
Q6_GROUP = 16          # weights per sub-scale
Q6_SUPER = 256         # weights per d


@dataclass
class Q6KWeights:
    """One Q6_K matrix (or Q6_K shards concatenated along N) in the plane layout above."""
    planes: torch.Tensor
    sub_scales: torch.Tensor
    d: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.planes.shape[0] * 4 // 3

    @property
    def out_features(self) -> int:
        return self.planes.shape[1]

    def to(self, device) -> "Q6KWeights":
        return Q6KWeights(self.planes.to(device), self.sub_scales.to(device), self.d.to(device))


def pack_q6k(codes: torch.Tensor, sub_scales: torch.Tensor, d: torch.Tensor) -> Q6KWeights:
    """codes int [K, N] in -32..31, sub_scales int8 [K/16, N], d fp16 [K/256, N] -> Q6KWeights."""
    k, n = codes.shape
    if k % Q6_CHUNK:                  # a file's Q6_K rows are whole super-blocks; dummy layers only whole chunks
        raise ValueError(f"Q6_K planes need K a multiple of {Q6_CHUNK}, got {k}")
    if codes.min() < -32 or codes.max() > 31:
        raise ValueError("Q6_K codes must lie in -32..31")
    if sub_scales.dtype != torch.int8 or tuple(sub_scales.shape) != (k // Q6_GROUP, n):
        raise ValueError(f"Q6_K sub-scales must be int8 [{k // Q6_GROUP}, {n}], got {sub_scales.dtype} "
                         f"{tuple(sub_scales.shape)}")
    if tuple(d.shape) != (-(-k // Q6_SUPER), n):
        raise ValueError(f"Q6_K d must be [{-(-k // Q6_SUPER)}, {n}], got {tuple(d.shape)}")
    # uint8 throughout: a 152k-row head's temporaries stay at a byte a weight
    u = (codes.to(torch.int16) + 32).to(torch.uint8).view(k // Q6_CHUNK, Q6_CHUNK, n)
    lo = (u & 0xF).view(-1, 2, 32, n)
    hi = (u >> 4).view(-1, 4, 16, n)
    low_plane = (lo[:, 0] | (lo[:, 1] << 4)).reshape(k // 2, n)
    high_plane = (hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)).reshape(k // 4, n)
    planes = torch.cat([low_plane, high_plane]).contiguous()
    return Q6KWeights(planes, sub_scales.contiguous(), d.to(torch.float16).contiguous())


def q6k_codes(w: Q6KWeights) -> torch.Tensor:
    """pack_q6k's inverse on the codes: -> int32 [K, N] in -32..31."""
    k, n = w.in_features, w.out_features
    p = w.planes.to(torch.int32)
    low, high = p[: k // 2].view(-1, 1, 32, n), p[k // 2:].view(-1, 1, 16, n)
    lo = torch.cat([low & 0xF, low >> 4], dim=1).reshape(-1, Q6_CHUNK, n)
    hi = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=1).reshape(-1, Q6_CHUNK, n)
    return (lo | (hi << 4)).reshape(k, n) - 32


def q6k_scales(w: Q6KWeights) -> torch.Tensor:
    """-> fp32 [K/16, N]: f32(d) * sc, the exact products gguf forms."""
    d = w.d.float().repeat_interleave(Q6_SUPER // Q6_GROUP, dim=0)[: w.sub_scales.shape[0]]
    return d * w.sub_scales.float()


def q6k_dequantize(w: Q6KWeights) -> torch.Tensor:
    """-> fp32 W [K, N] (the torch twin)."""
    return q6k_codes(w).float() * q6k_scales(w).repeat_interleave(Q6_GROUP, dim=0)


def q6k_bytes(k: int, n: int) -> int:
    """Bytes a Q6_K matrix [K, N] takes in this layout."""
    return k * n * 3 // 4 + k // Q6_GROUP * n + -(-k // Q6_SUPER) * n * 2


def concat_q6k(parts: list[Q6KWeights]) -> Q6KWeights:
    """Shards along N (one layer of Q6_K modules)."""
    return Q6KWeights(torch.cat([p.planes for p in parts], dim=1), torch.cat([p.sub_scales for p in parts], dim=1),
                      torch.cat([p.d for p in parts], dim=1))
