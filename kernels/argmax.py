"""Greedy sampling's argmax over the vocabulary, in two short launches.

torch's argmax of one 152k-entry fp16 row takes ~8.5 us on the H200 (bench/results/profile-decode-b1-h200.json),
half a percent of a batch-1 decode step. Here each row is cut into CHUNK-entry pieces that programs reduce side
by side, then one program a row picks the best piece. Ties go to the first index, as torch's do; a NaN counts as
+inf (torch ranks NaN above +inf: the two differ only on a row that holds both).
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton

CHUNK = 4096


@triton.jit
def _argmax_chunks_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, CHUNK: tl.constexpr):
    """Grid (rows, chunks): the best value of each CHUNK of a row and its first index."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    # NaN ranks first, as in torch (a NaN would lose every comparison, and a padding -inf could win the chunk)
    x = tl.where(x != x, float("inf"), x)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * tl.num_programs(1) + c, best)
    tl.store(idx_ptr + row * tl.num_programs(1) + c, c * CHUNK + at)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, chunks, CHUNKS_P2: tl.constexpr):
    """Grid (rows,): the best chunk of a row (the first of equal ones) -> its index."""
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS_P2)
    vals = tl.load(val_ptr + row * chunks + offs, mask=offs < chunks, other=float("-inf"))
    _, best = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * chunks + best).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> int64 [S], the first index of each row's largest value (torch.argmax(dim=-1))."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    return argmax_rows_triton(logits)


def argmax_rows_triton(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as argmax_rows (a NaN counts as +inf)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows needs [S, V] rows with unit stride, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(rows, chunks)](logits, vals, idx, vocab, logits.stride(0), CHUNK=CHUNK, num_warps=4)
    _argmax_merge_kernel[(rows,)](vals, idx, out, chunks, CHUNKS_P2=max(16, triton.next_power_of_2(chunks)),
                                  num_warps=1)
    return out
