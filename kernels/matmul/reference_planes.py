"""Torch twin of the 8-bit weight kernels (GGUF Q8_0, Q5_0, Q5_1 load here without re-quantizing, and Q5_K / Q6_K
merged with them; a layer of Q5_K or Q6_K shards only has its own planes, q5k.py / q6k.py).

Internal layout (K = in_features, N = out_features):
  qweight  int8 [K, N]                signed codes, one byte per weight
  scales   fp16/fp32 [G, N]           G = ceil(K / group_size)
  offsets  like scales [G, N] | None  float per-group offset (Q5_1, Q5_K); None = 0
Dequant: W[k, n] = q[k, n] * s[g, n] + o[g, n], g = k // group_size   (W is the transposed nn.Linear weight)
"""
import torch


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Internal layout -> dense W [K, N]. Math in fp32."""
    k = qweight.shape[0]
    group_of_row = torch.arange(k, device=qweight.device) // (group_size if group_size > 0 else k)
    w = qweight.float() * scales.float()[group_of_row]
    if offsets is not None:
        w += offsets.float()[group_of_row]
    return w.to(out_dtype)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                     group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype. fp32 accumulate."""
    y = x.float() @ dequantize_w8(qweight, scales, offsets, group_size)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
