"""Which batched-LoRA implementation runs: the Triton kernels on CUDA tensors, the torch twins elsewhere."""
import torch

from quant_serve.kernels.lora.reference import lora_expand_ref, lora_shrink_ref
from quant_serve.kernels.lora.triton_kernels import lora_expand_triton, lora_shrink_triton


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K], slots [T] (-1: no adapter) -> h [T, R] fp32."""
    if x.is_cuda:
        return lora_shrink_triton(x.contiguous(), a, slots)
    return lora_shrink_ref(x, a, slots)


def lora_expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                col_offset: int = 0) -> torch.Tensor:
    """y[:, col_offset:col_offset + N] += h @ b[slot]^T per row with a slot, in place; -> y."""
    if y.is_cuda and y.stride(-1) == 1:
        return lora_expand_triton(h, b, slots, y, col_offset)
    return lora_expand_ref(h, b, slots, y, col_offset)
