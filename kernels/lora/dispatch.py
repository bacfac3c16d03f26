"""Which batched-LoRA implementation runs: the Triton kernels on CUDA tensors, the torch twins elsewhere."""
import torch

from quant_serve.kernels.lora.reference import lora_expand_ref, lora_shrink_ref
from quant_serve.kernels.lora.triton_kernels import lora_expand_triton, lora_shrink_triton


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K], slots [T] (-1: no adapter) -> h [splits, T, R] fp32 partial sums over K."""
    if x.is_cuda:
        return lora_shrink_triton(x.contiguous(), a, slots)
    return lora_shrink_ref(x, a, slots)


def lora_expand(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                part_sizes: list[int] | None = None) -> torch.Tensor:
    """y[:, part i] += sum(h)[:, i * R:(i + 1) * R] @ b[slot, part i]^T per row with a slot, in place; -> y."""
    if y.is_cuda and y.stride(-1) == 1:
        return lora_expand_triton(h, b, slots, y, part_sizes)
    return lora_expand_ref(h, b, slots, y, part_sizes)
