"""The torch twins of the batched LoRA kernels: the CPU path and the contract the Triton kernels are tested against.

An adapter slot's weights are zero-padded to the stacks' rank R, and its scaling is folded into B at load, so a row
computes exactly y += (x @ A^T) @ B^T. Rows whose slot is -1 (the base model) are left as they are. h is kept in
fp32 between the two halves (a rank-16 intermediate: no bandwidth to save by rounding it), as partial sums over
splits of K ([splits, T, R]; the kernels split K so that one row's shrink spreads over many SMs, the twin has one
split) that the expand adds up.

A merged layer (qkv, gate_up) has one A stack with its parts' rank-R blocks side by side ([S, parts * R, K]) and one
B stack with its parts' outputs one after another ([S, N_0 + N_1 + ..., R]): output column n of part i reads
h[:, i * R:(i + 1) * R].
"""
import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, R, K] (one adapter per slot), slots [T] int (-1: none) -> h [1, T, R] fp32 (0 where none)."""
    h = torch.zeros(1, x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():          # segments of one adapter each (SGMV's grouping)
        if slot < 0:
            continue
        rows = slots == slot
        h[0, rows] = x[rows].float() @ a[slot].float().t()
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                    part_sizes: list[int] | None = None) -> torch.Tensor:
    """h [splits, T, parts * R] fp32 partial sums, b [S, N, R] with N = sum(part_sizes) (default: one part), slots
    [T] -> y [T, N] with y += h_i @ b[slot, part i's columns]^T on the rows with a slot (in place; the sum in fp32,
    rounded once to y's dtype). Returns y."""
    r = b.shape[2]
    part_sizes = part_sizes or [b.shape[1]]
    h = h.sum(0)
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        col = 0
        for i, n in enumerate(part_sizes):
            out = y[rows, col:col + n].float() + h[rows, i * r:(i + 1) * r] @ b[slot, col:col + n].float().t()
            y[rows, col:col + n] = out.to(y.dtype)
            col += n
    return y
