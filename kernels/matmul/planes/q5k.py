"""GGUF Q5_K kept at 5 bits in the W8A16 kernels: codes in two bit planes plus Q4_K's two-level scales as the file
stores them (kernels/matmul/frag/kquant.py), read by the same GEMV and dequantize kernels (kernels.py, the Q5 constexpr)
instead of int8 codes with a float scale and offset per 32.

  planes       uint8 [K/2 + K/8, N]   per 64-row chunk c of K: low plane row 32 c + j holds the low 4 bits of
                                      rows 64 c + j (low nibble) and 64 c + 32 + j (high nibble); high plane row
                                      K/2 + 8 c + j holds the top bit of rows 64 c + 8 t + j in bit t
  sub_codes    int16 [K/32, N]        sc | m << 8, the file's 6-bit sub-scale and sub-min codes per 32 weights
  superscales  int32 [K/256, N]       fp16 bits of d (low half) and dmin (high half) per 256 weights
  W[k, n] = q * (f32(d) * sc) - f32(dmin) * m, q the 5-bit code 0..31: gguf.quants.dequantize's fp32 products, so
  the dequant is bit-exact. Bits a weight: 4 + 1 + 16 / 32 + 32 / 256 = 5.625 (against 8 + 2 * 16 / 32 = 9 for
  int8 codes with an fp16 scale and offset per 32).

_q5_chunk / _q5_rows are the kernels' decoder and GEMV K loop for this layout (kernels.py calls them under Q5).
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.matmul.frag.kquant import KQ_GROUP, KQ_SUPER, check_kquant, kquant_scales_offsets

Q5_CHUNK = 64          # rows per plane chunk (the kernels' BLOCK_K)
Q5_GROUP = KQ_GROUP    # weights per sub-code (32)
Q5_SUPER = KQ_GROUP * KQ_SUPER     # weights per d | dmin (256)


@dataclass
class Q5KWeights:
    """One Q5_K matrix (or Q5_K shards concatenated along N) in the plane layout above."""
    planes: torch.Tensor
    sub_codes: torch.Tensor
    superscales: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.planes.shape[0] * 8 // 5

    @property
    def out_features(self) -> int:
        return self.planes.shape[1]

    def to(self, device) -> "Q5KWeights":
        return Q5KWeights(self.planes.to(device), self.sub_codes.to(device), self.superscales.to(device))


def pack_q5k(codes: torch.Tensor, sub_codes: torch.Tensor, superscales: torch.Tensor) -> Q5KWeights:
    """codes int [K, N] in 0..31, sub_codes int16 [K/32, N], superscales int32 [K/256, N] -> Q5KWeights."""
    k, n = codes.shape
    if k % Q5_CHUNK:                  # a file's Q5_K rows are whole super-blocks; dummy layers only whole chunks
        raise ValueError(f"Q5_K planes need K a multiple of {Q5_CHUNK}, got {k}")
    if codes.min() < 0 or codes.max() > 31:
        raise ValueError("Q5_K codes must lie in 0..31")
    if tuple(sub_codes.shape) != (k // Q5_GROUP, n):
        raise ValueError(f"Q5_K sub-codes must be [{k // Q5_GROUP}, {n}], got {tuple(sub_codes.shape)}")
    check_kquant(sub_codes, superscales)
    u = codes.to(torch.uint8).view(k // Q5_CHUNK, Q5_CHUNK, n)
    lo = (u & 0xF).view(-1, 2, 32, n)
    hi = (u >> 4).view(-1, 8, 8, n)
    low_plane = (lo[:, 0] | (lo[:, 1] << 4)).reshape(k // 2, n)
    high_plane = hi[:, 0].clone()
    for t in range(1, 8):
        high_plane |= hi[:, t] << t
    planes = torch.cat([low_plane, high_plane.reshape(k // 8, n)]).contiguous()
    return Q5KWeights(planes, sub_codes.contiguous(), superscales.contiguous())


def q5k_codes(w: Q5KWeights) -> torch.Tensor:
    """pack_q5k's inverse on the codes: -> int32 [K, N] in 0..31."""
    k, n = w.in_features, w.out_features
    p = w.planes.to(torch.int32)
    low, high = p[: k // 2].view(-1, 1, 32, n), p[k // 2:].view(-1, 1, 8, n)
    lo = torch.cat([low & 0xF, low >> 4], dim=1).reshape(-1, Q5_CHUNK, n)
    hi = torch.cat([(high >> t) & 1 for t in range(8)], dim=1).reshape(-1, Q5_CHUNK, n)
    return (lo | (hi << 4)).reshape(k, n)


def q5k_dequantize(w: Q5KWeights) -> torch.Tensor:
    """-> fp32 W [K, N] (the torch twin): q * s + o with kquant's exact fp32 products."""
    s, o = kquant_scales_offsets(w.sub_codes, w.superscales)                  # [K/32, N] each
    return q5k_codes(w).float() * s.repeat_interleave(Q5_GROUP, dim=0) + o.repeat_interleave(Q5_GROUP, dim=0)


def q5k_bytes(k: int, n: int) -> int:
    """Bytes a Q5_K matrix [K, N] takes in this layout."""
    return k * n * 5 // 8 + k // Q5_GROUP * n * 2 + -(-k // Q5_SUPER) * n * 4


def concat_q5k(parts: list[Q5KWeights]) -> Q5KWeights:
    """Shards along N (one layer of Q5_K modules)."""
    return Q5KWeights(torch.cat([p.planes for p in parts], dim=1), torch.cat([p.sub_codes for p in parts], dim=1),
                      torch.cat([p.superscales for p in parts], dim=1))


@triton.jit
def _q5_chunk(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K):
    """Q5 planes, 64-row chunk c -> (W rows 64 c + j, W rows 64 c + 32 + j), each fp32 [32, BLOCK_N]: the low
    plane's 32 byte rows once, the high plane's 8 rows four times (the repeats from L1); the chunk's two sub-blocks
    2c, 2c + 1 (sub-codes at s_ptr) lie in super-block c // 4 (d | dmin at o_ptr). w = q * (d * sc) - dmin * m,
    as gguf forms it."""
    j = tl.arange(0, 32)
    mask = n_mask[None, :]
    lo = tl.load(q_ptr + (c * 32 + j)[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    hb = tl.load(q_ptr + (K // 2 + c * 8 + j % 8)[:, None] * stride_qk + offs_n[None, :], mask=mask,
                 other=0).to(tl.int32)
    t = (j // 8)[:, None]                                        # rows 8 t + j % 8 of the chunk: bit t; + 4 above
    q_a = (lo & 0xF) | (((hb >> t) & 1) << 4)
    q_b = (lo >> 4) | (((hb >> (t + 4)) & 1) << 4)
    sm_a = tl.load(s_ptr + (c * 2) * stride_sg + offs_n, mask=n_mask, other=0).to(tl.int32)        # [BLOCK_N]
    sm_b = tl.load(s_ptr + (c * 2 + 1) * stride_sg + offs_n, mask=n_mask, other=0).to(tl.int32)
    dd = tl.load(o_ptr + (c // 4) * stride_sg + offs_n, mask=n_mask, other=0)
    d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    s_a = d * (sm_a & 0xFF).to(tl.float32)
    s_b = d * (sm_b & 0xFF).to(tl.float32)
    o_a = dmin * ((sm_a >> 8) & 0xFF).to(tl.float32)
    o_b = dmin * ((sm_b >> 8) & 0xFF).to(tl.float32)
    return q_a.to(tl.float32) * s_a[None, :] - o_a[None, :], q_b.to(tl.float32) * s_b[None, :] - o_b[None, :]


@triton.jit
def _q5_rows(x_ptr, q_ptr, s_ptr, o_ptr, pid_m, M, K, stride_xm, stride_qk, stride_sg, st_begin, st_end, offs_n,
             n_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The GEMV's K loop over Q5 planes, one 64-row chunk a step -> [BLOCK_M, BLOCK_N] fp32 (BLOCK_M 1: FMA rows;
    16: two tl.dot of 32 rows a step)."""
    j = tl.arange(0, 32)
    if BLOCK_M == 1:
        acc = tl.zeros([32, BLOCK_N], dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_xm
        for c in range(st_begin, st_end):
            w_a, w_b = _q5_chunk(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K)
            x_a = tl.load(x_row + c * 64 + j).to(tl.float32)
            x_b = tl.load(x_row + c * 64 + 32 + j).to(tl.float32)
            acc += w_a * x_a[:, None] + w_b * x_b[:, None]
        res = tl.sum(acc, axis=0)[None, :]                                      # [1, BLOCK_N]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in range(st_begin, st_end):
            w_a, w_b = _q5_chunk(q_ptr, s_ptr, o_ptr, c, offs_n, n_mask, stride_qk, stride_sg, K)
            x_a = tl.load(x_rows + (c * 64 + j)[None, :])                          # [BM, 32]
            x_b = tl.load(x_rows + (c * 64 + 32 + j)[None, :])
            acc = tl.dot(x_a, w_a.to(x_a.dtype), acc)
            acc = tl.dot(x_b, w_b.to(x_b.dtype), acc)
        res = acc
    return res
