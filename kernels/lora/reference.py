"""The torch twins of the batched LoRA kernels: the CPU path and the contract the Triton kernels are tested against.

An adapter slot's weights are zero-padded to the stacks' rank R, and its scaling is folded into B at load, so a row
computes exactly y += (x @ A^T) @ B^T. Rows whose slot is -1 (the base model) are left as they are. h is kept in
fp32 between the two halves (a rank-8 intermediate: no bandwidth to save by rounding it).
"""
import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K] (one adapter per slot), slots [T] int (-1: none) -> h [T, R] fp32 (0 where none)."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():          # segments of one adapter each (SGMV's grouping)
        if slot < 0:
            continue
        rows = slots == slot
        h[rows] = x[rows].float() @ a[slot].float().t()
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                    col_offset: int = 0) -> torch.Tensor:
    """h [T, R] fp32, b [S, N, R], slots [T] -> y [T, >= col_offset + N] with y[:, col_offset:col_offset + N] +=
    h @ b[slot]^T on the rows with a slot (in place; the sum in fp32, rounded once to y's dtype). Returns y."""
    n = b.shape[1]
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        out = y[rows, col_offset:col_offset + n].float() + h[rows].float() @ b[slot].float().t()
        y[rows, col_offset:col_offset + n] = out.to(y.dtype)
    return y
