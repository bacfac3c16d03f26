"""GGUF tensor types -> quant-serve's internal layouts, without re-quantizing (formats.md, GGUF).

A GGUF matrix of nn.Linear shape [N, K] is stored row by row, each row a run of blocks along K, so a block is one
group of the internal layouts (groups along K, one per output column n):
  Q4_0  (32: fp16 d, 16 B nibbles)              W = d (q - 8)        -> INT4, scale d, offset -8 d
  Q4_1  (32: fp16 d, m, 16 B nibbles)           W = d q + m          -> INT4, scale d, offset m
  Q4_K  (256: fp16 d, dmin, 12 B 6-bit sub-scales/mins, 128 B)  W = (d sc) q - (dmin m) per 32
                                                                     -> INT4, fp32 scale d sc, offset -dmin m
  Q8_0  (32: fp16 d, 32 int8)                   W = d q              -> W8, scale d
  Q5_0  (32: fp16 d, 4 B high bits, 16 B)       W = d (q - 16)       -> W8, codes q - 16, scale d
  Q5_1  (32: fp16 d, m, 4 B high bits, 16 B)    W = d q + m          -> W8, scale d, offset m
  Q5_K  (256: as Q4_K plus 32 B high bits)      W = (d sc) q - (dmin m) per 32 -> W8 (a layer of Q5_K only:
                                                 5-bit planes + Q4_K's two-level scales, kernels/matmul/planes/q5k.py)
  Q6_K  (256: 128 B low, 64 B high, 16 int8 scales, fp16 d)  W = (d sc) (q - 32) per 16 -> W8, group 16
  F32 / F16 / BF16                               dense
Each product d * sc and each q * scale is exact in fp32 (at most 21 significant bits), so W = q * s + o rounds once,
as gguf.quants.dequantize does: the conversion is bit-exact on the dequantized weights (tests/quant/test_gguf_types.py).
"""
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from quant_serve.kernels.matmul.frag.kquant import pack_sub_codes, pack_superscales
from quant_serve.kernels.matmul.reference import pack_int4_rows
from quant_serve.kernels.matmul.planes.q5k import Q5KWeights, pack_q5k
from quant_serve.kernels.matmul.planes.q6k import Q6KWeights, pack_q6k

INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
W8_TYPES = (T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K)
DENSE_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = INT4_TYPES + W8_TYPES + DENSE_TYPES
GROUP_SIZE = {T.Q6_K: 16}                 # every other quantized type: 32 weights per scale


def group_size_of(qtype: T) -> int:
    return GROUP_SIZE.get(qtype, 32)


def path_of(qtype: T) -> str:
    """Which linear implementation a tensor type loads into: 'int4', 'w8' or 'dense'."""
    if qtype in INT4_TYPES:
        return "int4"
    if qtype in W8_TYPES:
        return "w8"
    if qtype in DENSE_TYPES:
        return "dense"
    raise ValueError(f"GGUF tensor type {qtype.name} is not supported (supported: "
                     f"{', '.join(t.name for t in SUPPORTED_TYPES)})")


@dataclass
class GroupedCodes:
    """One GGUF matrix as integer codes with a float scale and offset per group along K: W = q * s + o."""
    codes: torch.Tensor                  # int32 [N, K]: 0..15 for the INT4 path, -32..31 for W8
    scales: torch.Tensor                 # fp16 / fp32 [N, K / group]
    offsets: torch.Tensor | None         # like scales, or None (= 0)
    group_size: int
    # Q4_K / Q5_K as stored (kernels/matmul/frag/kquant.py), beside the fp32 products above: int16 sc | m << 8 [N, K / 32] and
    # int32 fp16 bits d | dmin << 16 [N, K / 256]; Q6_K (kernels/matmul/planes/q6k.py): int8 sub-scales [N, K / 16] and
    # fp16 d [N, K / 256]; None for every other type
    sub_codes: torch.Tensor | None = None
    superscales: torch.Tensor | None = None

    def to(self, device) -> "GroupedCodes":
        def move(t):
            return None if t is None else t.to(device)
        return GroupedCodes(self.codes.to(device), self.scales.to(device), move(self.offsets), self.group_size,
                            move(self.sub_codes), move(self.superscales))

    def rows(self, index: torch.Tensor) -> "GroupedCodes":
        """The output rows `index` (a loader's row order) of every per-row tensor."""
        def pick(t):
            return None if t is None else t[index]
        return GroupedCodes(self.codes[index], self.scales[index], pick(self.offsets), self.group_size,
                            pick(self.sub_codes), pick(self.superscales))


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[B, 2] uint8 -> [B] fp16."""
    return raw.contiguous().view(torch.float16).reshape(-1)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """[..., C] bytes -> [..., 8, C]: bit j of every byte (little-endian bit order)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device).view(8, 1)
    return (raw.unsqueeze(-2) >> shifts) & 1


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32]: low nibbles are weights 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits_32(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes, one little-endian uint32 -> [B, 32]: bit i belongs to weight i."""
    return _bits(qh.unsqueeze(-1)).reshape(qh.shape[0], 32)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: [B, 12] bytes -> 6-bit sub-block scales and mins [B, 8] each. Bytes 0-3 hold scales 0-3 (low
    6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    s, m, lo = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([s & 0x3F, (lo & 0x0F) | ((s >> 6) << 4)], dim=1)
    mins = torch.cat([m & 0x3F, (lo >> 4) | ((m >> 6) << 4)], dim=1)
    return scales, mins


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: [B, 128] bytes -> [B, 256]: each run of 32 bytes holds sub-block 2j in its low nibbles and
    sub-block 2j + 1 in its high nibbles."""
    runs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(-1, 256)


def _blocks(data, qtype: T, k: int, device) -> torch.Tensor:
    """[N, bytes per row] uint8 (numpy, as GGUFReader gives it, or torch) -> [N * K / block, block bytes] on
    device."""
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block} weights, got {k}")
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ValueError(f"{qtype.name} data has dtype {data.dtype}, expected uint8")
        data = torch.from_numpy(np.array(data))                  # a copy: the reader's memmap is read-only
    if data.dtype != torch.uint8 or data.shape[-1] != k // block * size:
        raise ValueError(f"{qtype.name} data has shape {tuple(data.shape)} and dtype {data.dtype}, expected uint8 "
                         f"rows of {k // block * size} bytes for {k} weights")
    return data.to(device).reshape(-1, size)


def read_grouped(data, qtype: T, n: int, k: int, device: torch.device | str = "cpu") -> GroupedCodes:
    """A quantized GGUF matrix (data: [N, bytes per row] uint8, as GGUFReader gives it) -> codes, scales, offsets
    per group, each [N, ...], computed on `device` (bit operations: milliseconds a matrix on a GPU)."""
    b = _blocks(data, qtype, k, device)
    f32, i32 = torch.float32, torch.int32
    sub_codes = superscales = None
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        d = _f16(b[:, 0:2])
        has_min = qtype in (T.Q4_1, T.Q5_1)
        at = 4 if has_min else 2
        if qtype in (T.Q5_0, T.Q5_1):
            q = _nibbles_32(b[:, at + 4:]) | (_bits_32(b[:, at:at + 4]) << 4)
        else:
            q = _nibbles_32(b[:, at:])
        codes = q.to(i32)
        if has_min:
            offsets = _f16(b[:, 2:4])
        elif qtype == T.Q4_0:
            offsets = -8 * d                                    # exact in fp16
        else:
            codes, offsets = codes - 16, None                   # Q5_0: signed codes, no offset
        scales = d
    elif qtype == T.Q8_0:
        codes = b[:, 2:].contiguous().view(torch.int8).to(i32)
        scales, offsets = _f16(b[:, 0:2]), None
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]).to(f32), _f16(b[:, 2:4]).to(f32)
        sc, mn = _k_scales_mins(b[:, 4:16])
        if qtype == T.Q4_K:
            q = _k_nibbles(b[:, 16:])
        else:
            high = _bits(b[:, 16:48])                           # [B, 8, 32]: bit j of byte l -> weight 32 j + l
            q = _k_nibbles(b[:, 48:]) | (high.reshape(-1, 256) << 4)
        codes = q.to(i32)
        scales = (d[:, None] * sc.to(f32)).reshape(-1)
        offsets = -(dmin[:, None] * mn.to(f32)).reshape(-1)
        sub_codes = pack_sub_codes(sc, mn).reshape(n, k // 32)                      # the two levels as stored
        superscales = pack_superscales(_f16(b[:, 0:2]), _f16(b[:, 2:4])).reshape(n, k // 256)
    elif qtype == T.Q6_K:
        ql, qh = b[:, 0:128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 256)
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(-1, 256)
        codes = (low | (high << 4)).to(i32) - 32
        sc = b[:, 192:208].contiguous().view(torch.int8).to(f32)                      # [B, 16]
        scales = (_f16(b[:, 208:210]).to(f32)[:, None] * sc).reshape(-1)
        offsets = None
        sub_codes = b[:, 192:208].contiguous().view(torch.int8).reshape(n, k // 16)
        superscales = _f16(b[:, 208:210]).reshape(n, k // 256)
    else:
        raise ValueError(f"GGUF tensor type {qtype.name} has no grouped-code reader (supported: "
                         f"{', '.join(t.name for t in INT4_TYPES + W8_TYPES)})")
    gs = group_size_of(qtype)
    return GroupedCodes(codes.reshape(n, k), scales.reshape(n, k // gs),
                        None if offsets is None else offsets.reshape(n, k // gs), gs, sub_codes, superscales)


def read_dense(data: np.ndarray, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Any supported GGUF tensor -> float tensor of `shape` (quantized types through gguf.quants.dequantize)."""
    if qtype == T.F32:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float32).reshape(shape).copy())
    if qtype == T.F16:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float16).reshape(shape).copy())
    if qtype == T.BF16:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16).reshape(shape).copy()).view(torch.bfloat16)
    path_of(qtype)
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(data, qtype).reshape(shape).copy())


def int4_layout(g: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT4 codes [N, K] -> internal (qweight int32 [K/8, N], scales [G, N], offsets [G, N])."""
    return pack_int4_rows(g.codes.t().contiguous()), g.scales.t().contiguous(), g.offsets.t().contiguous()


def kquant_layout(g: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K codes [N, K] -> (qweight int32 [K/8, N], sub_codes int16 [G, N], superscales int32 [G/8, N])."""
    if g.superscales is None:
        raise ValueError("kquant_layout needs Q4_K grouped codes (sub-codes and super-scales)")
    return pack_int4_rows(g.codes.t().contiguous()), g.sub_codes.t().contiguous(), g.superscales.t().contiguous()


def q6k_layout(g: GroupedCodes) -> Q6KWeights:
    """Q6_K codes [N, K] -> the 6-bit plane layout (planes [3K/4, N], sub-scales int8 [K/16, N], d [K/256, N])."""
    if g.superscales is None or g.sub_codes is None or g.sub_codes.dtype != torch.int8:
        raise ValueError("q6k_layout needs Q6_K grouped codes (int8 sub-scales and fp16 d)")
    return pack_q6k(g.codes.t(), g.sub_codes.t(), g.superscales.t())


def q5k_layout(g: GroupedCodes) -> Q5KWeights:
    """Q5_K codes [N, K] -> the 5-bit plane layout (planes [5K/8, N], sub-codes int16 [K/32, N], d | dmin int32
    [K/256, N])."""
    if g.superscales is None or g.sub_codes is None or g.sub_codes.dtype != torch.int16:
        raise ValueError("q5k_layout needs Q5_K grouped codes (int16 sub-codes and int32 d | dmin)")
    return pack_q5k(g.codes.t(), g.sub_codes.t(), g.superscales.t())


def w8_layout(g: GroupedCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes [N, K] -> W8 internal (qweight int8 [K, N], scales [G, N], offsets [G, N] or None)."""
    offsets = None if g.offsets is None else g.offsets.t().contiguous()
    return g.codes.t().to(torch.int8).contiguous(), g.scales.t().contiguous(), offsets
