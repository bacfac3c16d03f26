"""The dense (FP16/BF16/FP32) linear layer, and the float-dtype check every layer's loader applies to weights,
scales and biases. A merged layer (qkv, gate_up) is filled shard by shard from the checkpoint's separate modules."""
import torch
from torch import nn

from quant_serve.kernels.norm_act import silu_and_mul


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float(t: torch.Tensor, name: str) -> None:
    """Weights, scales and biases that become float parameters: an integer tensor would be cast silently."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, expected a float dtype "
                         "(float16, bfloat16 or float32)")


class DenseLinear(nn.Module):
    """FP16/BF16/FP32 linear: weight [N, K] with N = sum(output_sizes)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def shard_rows(self, shard_id: int) -> slice:
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])

    def load_shard(self, shard_id: int, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        rows = self.shard_rows(shard_id)
        if "weight" not in tensors:
            found = ", ".join(sorted(tensors)) or "nothing"
            raise ValueError(f"{prefix}: expected a dense 'weight' tensor, found {found} "
                             "(is this a quantized checkpoint without a quantization_config?)")
        weight = tensors["weight"]
        expected = (self.output_sizes[shard_id], self.in_features)
        check_float(weight, f"{prefix}.weight")
        if tuple(weight.shape) != expected:
            raise ValueError(f"{prefix}.weight has shape {tuple(weight.shape)}, expected {expected}")
        self.weight.data[rows].copy_(weight)
        if "bias" in tensors:
            if self.bias is None:
                raise ValueError(f"{prefix}.bias present but the config says this layer has no bias")
            bias = tensors["bias"]
            check_float(bias, f"{prefix}.bias")
            if tuple(bias.shape) != (expected[0],):
                raise ValueError(f"{prefix}.bias has shape {tuple(bias.shape)}, expected {(expected[0],)}")
            self.bias.data[rows].copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A merged gate | up layer followed by the SwiGLU activation: [T, K] -> silu(gate) * up [T, N/2]."""
        return silu_and_mul(self(x))
