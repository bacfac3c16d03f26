"""W8A16 entry point (`w8a16_matmul`). CPU tensors run the torch twin (reference.py)."""
import torch

from quant_serve.kernels.w8a16.reference import w8a16_matmul_ref


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] fp16/bf16 -> [..., N] in x's dtype; weights in the layout of reference.py."""
    if x.is_cuda:
        raise NotImplementedError("W8A16 on CUDA: the Triton kernel lands with issue 33's kernel work")
    lead = x.shape[:-1]
    y = w8a16_matmul_ref(x.reshape(-1, x.shape[-1]), qweight, scales, offsets, group_size, bias)
    return y.reshape(*lead, y.shape[-1])
