"""The exact window of an integer KV cache: each running sequence's last R tokens of K/V are also kept unquantized
(model dtype, rotated as the cache is) in a ring of R slots, and attention reads those keys and values exact.

Why: most of a query's attention mass sits on the last few tokens, and quantization error there costs the most.
A 24-token window takes int4 with one scale per token and head (4.13 bits an element) from 90.2% to 97.4% top-1
agreement with an FP16 cache on the demo model (docs/performance.md, "Integer KV cache"), for a fixed
max_num_seqs x R tokens of memory instead of finer scales on every token. KIVI keeps such a full-precision
residual as well.

Semantics (torch twin kernels/attention/reference.py, Triton kernels/attention/kv_int_kernels.py): the query at
position q of sequence b reads key j exact iff q - R < j and the exact value is at hand:
  - j is one of this step's new tokens (j >= seq_len - q_len): from new_k / new_v, row query_start + j - ctx;
  - ring_lo[b] <= j < ring_hi[b]: from ring_k / ring_v [rows, R, Hkv, D], row ring_row[b], slot j % R.
Otherwise it reads the quantized cache. A decode step (q_len 1) thus sees its whole window exact, and so does
every query of a prefill chunk (its window is inside the chunk or in the ring), which is what eval measures.
The ring is written after attention (write_ring): a chunk longer than R would otherwise overwrite what its own
first queries read. Which ring positions are valid is host bookkeeping (engine/worker/kv_exact_rows.py).
"""
from dataclasses import dataclass, replace

import torch


@dataclass
class ExactRows:
    """One step's indices into the rings (the same for every layer)."""
    ring_row: torch.Tensor     # [B] int32: the sequence's ring row
    ring_lo: torch.Tensor      # [B] int32: the ring holds this sequence's positions [ring_lo, ring_hi) ...
    ring_hi: torch.Tensor      # [B] int32: ... each at slot position % R (empty when lo >= hi)
    ring_slot: torch.Tensor    # [T] int64: flat ring slot (row * R + position % R) each new token is written to;
    #                            tokens that will not be read from the ring go to the spare row (the last)

    def split(self, d: int) -> tuple["ExactRows", "ExactRows"]:
        """The first d sequences / tokens (a mixed step's decodes, one token each) and the rest."""
        head = ExactRows(self.ring_row[:d], self.ring_lo[:d], self.ring_hi[:d], self.ring_slot[:d])
        tail = ExactRows(self.ring_row[d:], self.ring_lo[d:], self.ring_hi[d:], self.ring_slot[d:])
        return head, tail


@dataclass
class ExactWindow:
    """One layer's exact window for one attention call: this step's K/V (after RoPE and rotation, before
    quantization) and the layer's rings."""
    new_k: torch.Tensor        # [T, Hkv, D]
    new_v: torch.Tensor        # [T, Hkv, D]
    ring_k: torch.Tensor       # [rows, R, Hkv, D], model dtype
    ring_v: torch.Tensor
    rows: ExactRows

    @property
    def size(self) -> int:
        return self.ring_k.shape[1]

    def split(self, d: int) -> tuple["ExactWindow", "ExactWindow"]:
        head, tail = self.rows.split(d)
        return (replace(self, new_k=self.new_k[:d], new_v=self.new_v[:d], rows=head),
                replace(self, new_k=self.new_k[d:], new_v=self.new_v[d:], rows=tail))


def alloc_rings(rows: int, size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's zeroed (ring_k, ring_v), each [rows, size, Hkv, D]."""
    shape = (rows, size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def ring_bytes(rows: int, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Memory of every layer's K and V rings."""
    return 2 * num_layers * rows * size * num_kv_heads * head_dim * dtype_bytes


def write_ring(exact: ExactWindow) -> None:
    """This step's K/V into their ring slots (after attention: see the module doc)."""
    flat_k = exact.ring_k.view(-1, *exact.ring_k.shape[2:])
    flat_v = exact.ring_v.view(-1, *exact.ring_v.shape[2:])
    flat_k[exact.rows.ring_slot] = exact.new_k.to(flat_k.dtype)
    flat_v[exact.rows.ring_slot] = exact.new_v.to(flat_v.dtype)


def gather_exact(exact: ExactWindow, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin's view of the exact values: each sequence's last W = max q_len + R - 1 positions (every key some
    query's window can reach), right-aligned: (positions [B, W] (negative: before the sequence), k, v [B, W, Hkv, D]
    fp32, at hand [B, W] bool: a new token or a ring slot; zero where not at hand)."""
    rows, size = exact.rows, exact.size
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long().view(-1, 1)
    width = int(q_lens.max()) + size - 1
    ends = seq_lens.long().view(-1, 1)
    pos = ends - width + torch.arange(width, device=seq_lens.device).view(1, -1)      # [B, W]
    ctx = ends - q_lens
    is_new = pos >= ctx
    in_ring = (pos >= rows.ring_lo.long().view(-1, 1)) & (pos < rows.ring_hi.long().view(-1, 1)) & ~is_new \
        & (pos >= 0)
    new_row = (query_start_loc[:-1].long().view(-1, 1) + pos - ctx).clamp(0, max(exact.new_k.shape[0] - 1, 0))
    ring_at = rows.ring_row.long().view(-1, 1) * size + pos % size                     # [B, W]
    have = is_new | in_ring
    out = []
    for new, ring in ((exact.new_k, exact.ring_k), (exact.new_v, exact.ring_v)):
        flat = ring.view(-1, *ring.shape[2:])
        x = torch.where(is_new[..., None, None], new[new_row].float(), flat[ring_at].float())
        out.append(x * have[..., None, None])
    return pos, out[0], out[1], have
