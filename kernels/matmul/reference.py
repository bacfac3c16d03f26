"""Torch twin of the W4A16 GEMM family, over quant-serve's one internal INT4 layout.

Internal layout (every checkpoint format converts to this at load; K = in_features, N = out_features):
  qweight  int32 [K/8, N]        4-bit codes packed along K, sequential: nibble j of qweight[i, n] = q[8i+j, n]
  scales   fp16/bf16/fp32 [G, N] G = ceil(K / group_size); group_size -1 is stored as K (one group)
  qzeros   int32 [G, N/8] | None real zero points (no +1 offset) packed along N, sequential:
                                 nibble c of qzeros[g, j] = z[g, 8j+c]; None = symmetric, z = 8
  offsets  like scales [G, N] | None   float per-group offset (GGUF Q4_0 / Q4_1 / Q4_K); only with qzeros None
  perm     int64 [K] | None      act-order: internal row r holds original input channel perm[r]; y = x[:, perm] @ W
Dequant (W is the transposed nn.Linear weight, g = k // group_size):
  integer zero points (AWQ, GPTQ, compressed-tensors):  W[k, n] = (q[k, n] - z[g, n]) * s[g, n]
  float offsets (GGUF):                                  W[k, n] = q[k, n] * s[g, n] + o[g, n]
"""
import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R/8, C] int32 packed along dim 0 -> [R, C] int32 codes 0..15."""
    shifts = _SHIFTS.to(packed.device).view(1, 8, 1)
    codes = (packed.unsqueeze(1) >> shifts) & 0xF                      # [R/8, 8, C]
    return codes.reshape(-1, packed.shape[1])


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 (R % 8 == 0) -> [R/8, C] int32 packed along dim 0."""
    rows, cols = codes.shape
    if rows % 8:
        raise ValueError(f"cannot pack {rows} rows into int32 words of 8 nibbles")
    c = codes.to(torch.int32).reshape(rows // 8, 8, cols)
    # OR in int32 (the shift by 28 wraps into the sign bit): ~10x faster than an int64 sum, no int64 temporaries.
    words = c[:, 0].clone()
    for j in range(1, 8):
        words |= c[:, j] << (4 * j)
    return words


def unpack_int4_cols(packed: torch.Tensor) -> torch.Tensor:
    """[R, C/8] int32 packed along dim 1 -> [R, C] int32 codes 0..15."""
    shifts = _SHIFTS.to(packed.device).view(1, 1, 8)
    codes = (packed.unsqueeze(2) >> shifts) & 0xF                      # [R, C/8, 8]
    return codes.reshape(packed.shape[0], -1)


def pack_int4_cols(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 (C % 8 == 0) -> [R, C/8] int32 packed along dim 1."""
    return pack_int4_rows(codes.t().contiguous()).t().contiguous()


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                  group_size: int, out_dtype: torch.dtype = torch.float32,
                  offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Internal layout -> dense W [K, N] (rows in internal order). Math in fp32."""
    q = unpack_int4_rows(qweight)                                      # [K, N]
    k = q.shape[0]
    if group_size <= 0:
        group_size = k
    group_of_row = torch.arange(k, device=q.device) // group_size
    if offsets is not None:
        if qzeros is not None:
            raise ValueError("a layer has either integer zero points or float offsets, not both")
        w = q.float() * scales.float()[group_of_row] + offsets.float()[group_of_row]
        return w.to(out_dtype)
    z = unpack_int4_cols(qzeros) if qzeros is not None else torch.full_like(scales, 8, dtype=torch.int32)
    z = z[:, : q.shape[1]]
    w = (q - z[group_of_row]).float() * scales.float()[group_of_row]
    return w.to(out_dtype)


def w4a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                     group_size: int, perm: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype. fp32 accumulate."""
    w = dequantize_w4(qweight, scales, qzeros, group_size, torch.float32, offsets)
    if perm is not None:
        x = x[..., perm]
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
