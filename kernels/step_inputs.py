"""A decode step's input ids that the step still in flight samples: taken on the device, in one launch.

With async scheduling the host launches step N + 1 before step N's tokens reach it; those tokens are N + 1's
inputs. ids[i] = tokens[rows[i]] where rows[i] >= 0 (the row of the sequence in step N's samples), else ids[i]
stays the host's token. One small program instead of the index / index_put pair and their index copies.
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton


# one compile per BLOCK: the count and the buffers' alignment vary step to step
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["ids_ptr", "rows_ptr", "tokens_ptr"])
def _take_carried_kernel(ids_ptr, rows_ptr, tokens_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs, mask=offs < n, other=-1)
    carried = rows >= 0
    tokens = tl.load(tokens_ptr + tl.maximum(rows, 0), mask=carried, other=0)
    tl.store(ids_ptr + offs, tokens, mask=carried)


def take_carried_ref(ids: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """The twin: ids [n] int64 (in place), rows [n] int64 (-1: keep), tokens [S] int64."""
    carried = rows >= 0
    ids[carried] = tokens[rows[carried]]


def take_carried(ids: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids[i] = tokens[rows[i]] where rows[i] >= 0, in place (ids, rows [n] int64; tokens [S] int64)."""
    if not ids.is_cuda:
        take_carried_ref(ids, rows, tokens)
    else:
        take_carried_triton(ids, rows, tokens)


def take_carried_triton(ids: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """Same contract as take_carried; one program (n is a decode batch: <= 512), compiled once per power of two
    from 16 (carried_block)."""
    if ids.shape != rows.shape or ids.dim() != 1:
        raise ValueError(f"ids {tuple(ids.shape)} and rows {tuple(rows.shape)} must be the same 1-d shape")
    if ids.shape[0]:
        _take_carried_kernel[(1,)](ids, rows, tokens.contiguous(), ids.shape[0],
                                   BLOCK=carried_block(ids.shape[0]))


def carried_block(n: int) -> int:
    """The kernel's BLOCK for n ids (a start-up warm-up compiles each one a server can meet)."""
    return max(16, triton.next_power_of_2(n))
