"""A small quantizer for the GGUF K-quants Q4_K, Q5_K and Q6_K (the `gguf` package dequantizes them but does not
quantize): round-to-nearest per sub-block, sub-scales rounded against the super-block's fp16 scale. It writes the
exact byte layout llama.cpp reads (checked against gguf.quants.dequantize in tests/quant/test_gguf_types.py); it does
not search scales as llama.cpp's quantizer does, so its error is somewhat larger. For fixtures and dummy weights."""
import numpy as np
from gguf import GGMLQuantizationType as T

QK = 256


def _fp16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [B, 8] -> the 12-byte Q4_K / Q5_K field (see gguf_types._k_scales_mins)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    s = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    m = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    lo = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([s, m, lo], axis=1)


def _pack_k_nibbles(q: np.ndarray) -> np.ndarray:
    """[B, 256] 4-bit values -> [B, 128]: run r of 32 bytes holds sub-block 2r low, 2r + 1 high."""
    runs = q.reshape(-1, 4, 2, 32).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_min_k(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x [B, 256] -> (d, dmin [B] fp16-valued, sc, mn [B, 8] 0..63, q [B, 256] 0..levels)."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    scale, mins = (hi - lo) / levels, -lo                       # per sub-block, W = scale * q - mins
    d = _fp16_round(scale.max(axis=1) / 63)
    dmin = _fp16_round(mins.max(axis=1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d[:, None]), 0, 63), 0)
        mn = np.where(dmin[:, None] > 0, np.clip(np.rint(mins / dmin[:, None]), 0, 63), 0)
        eff_scale = (d[:, None] * sc)[:, :, None]
        eff_min = (dmin[:, None] * mn)[:, :, None]
        q = np.where(eff_scale > 0, np.rint((sub + eff_min) / eff_scale), 0)
    q = np.clip(q, 0, levels).reshape(-1, QK)
    return d, dmin, sc, mn, q


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _quantize_min_k(x, 15)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, mn), _pack_k_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _quantize_min_k(x, 31)
    q = q.astype(np.uint8)
    high = ((q >> 4) & 1).reshape(-1, 8, 32)                      # byte l, bit j: weight 32 j + l
    qh = np.packbits(high, axis=1, bitorder="little").reshape(-1, 32)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           dmin.astype(np.float16).view(np.uint8).reshape(-1, 2),
                           _pack_k_scales(sc, mn), qh, _pack_k_nibbles(q & 0x0F)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31                          # q in -32..31
    d = _fp16_round(scale.max(axis=1) / 127)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d[:, None]), -128, 127), 0)
        eff = (d[:, None] * sc)[:, :, None]
        q = np.where(eff > 0, np.rint(sub / eff), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)   # two halves of 128 weights
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)            # [B, 2, 64]
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)    # [B, 2, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)


K_QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(weight: np.ndarray, qtype: T) -> np.ndarray:
    """weight [N, K] float -> GGUF bytes [N, K / 256 * block bytes] uint8 (K-quants here, the rest through
    gguf.quants.quantize)."""
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if qtype not in K_QUANTIZERS:
        from gguf.quants import quantize as gguf_quantize
        return gguf_quantize(w, qtype)
    n, k = w.shape
    if k % QK:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {QK} weights, got {k}")
    return K_QUANTIZERS[qtype](w.reshape(-1, QK)).reshape(n, -1)
