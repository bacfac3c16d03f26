"""CUDA graphs for verification steps: a speculating decode forwards its last token and its k proposals, and the
target's logits at all k + 1 positions decide what is accepted. Eagerly, such a step pays a few hundred kernel
launches (about 1.5 ms on a 7B model at batch 1, as much as the graphed decode step itself); replaying a graph
removes them, as engine/worker/cuda_graph.py does for decode steps.

One graph per batch bucket up to the batch above which speculation is off (SpeculativeConfig.disable_by_batch_size),
all at t = k + 1 token rows per sequence (k is fixed per engine). A bucket of bs sequences has bs * t token rows
and bs + 1 sequences: the real entries take the first rows (any n <= t tokens each: fewer proposals, plain
decodes), the extra sequence owns every row the real ones leave (padding: slot -1 stores nothing, its own
context of those rows over block 0), and the sequences after it have no rows. The attention is the varlen prefill
kernel, which reads every per-sequence value on the device (kernels/attention/paged.paged_prefill: no host value
in its launch but shapes), so one capture serves every mix of lengths. The head runs inside the graph over all
rows (fp32 logits); sampling and acceptance stay outside.

The inputs reach the graph as one packed host buffer and one copy (VerifyInputs), laid out like DecodeInputs.

VerifyRowGraphs (KernelOptions.verify_rows) runs the same step as one decode row per token instead: row i of a
sequence is a decode of position p + i over a context of p + i + 1 tokens, through decode graphs of their own
(engine/worker/cuda_graph.py, with the K/V store before the decode kernel, since rows of one sequence read each other's
K/V). The prefill kernel walks each sequence's context in one program per KV head (slow for long contexts at small
batches); the decode kernel splits it. The head runs outside the graph, over the real rows."""
import logging
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from quant_serve.engine.worker.attention import AttentionMetadata
from quant_serve.engine.worker.cuda_graph import BUCKETS, DecodeGraphs, _capture, _dtype

logger = logging.getLogger("quant_serve")


@dataclass
class VerifyInputs:
    """Byte layout of a verification step's inputs, the same on the host and in the device blob: int64
    [max_batch * t] each of input ids, positions and slots (each padded to 16 bytes), then int32 seq_lens [max_batch + 1], query_start_loc
    [max_batch + 2] and the block tables [max_batch + 1, max_blocks] (a bucket's graph reads the first rows)."""
    max_batch: int
    tokens_per_seq: int          # t = k + 1
    max_blocks: int

    @property
    def max_rows(self) -> int:
        return self.max_batch * self.tokens_per_seq

    @property
    def column_bytes(self) -> int:
        """Bytes of each int64 column: whole 16-byte units, so that every column starts 16-byte aligned (Triton
        specializes pointer arguments on it)."""
        return 16 * -(-self.max_rows // 2)

    @property
    def lens_offset(self) -> int:
        return 3 * self.column_bytes

    @property
    def starts_offset(self) -> int:
        return self.lens_offset + 4 * (self.max_batch + 1)

    @property
    def table_offset(self) -> int:
        return self.starts_offset + 4 * (self.max_batch + 2)

    @property
    def nbytes(self) -> int:
        return self.table_offset + 4 * (self.max_batch + 1) * self.max_blocks

    def views(self, blob):
        """blob (uint8, torch or numpy) -> (ids, positions, slots, seq_lens, query_start_loc, tables [rows,
        max_blocks])."""
        rows, col, i64, i32 = self.max_rows, self.column_bytes, _dtype(blob, 8), _dtype(blob, 4)
        cols = [blob[col * i: col * i + 8 * rows].view(i64) for i in range(3)]
        lens = blob[self.lens_offset: self.starts_offset].view(i32)
        starts = blob[self.starts_offset: self.table_offset].view(i32)
        tables = blob[self.table_offset: self.nbytes].view(i32).reshape(-1, self.max_blocks)
        return (*cols, lens, starts, tables)

    def pack(self, bs: int, ids: list[list[int]], positions: list[int], slots: list[list[int]],
             tables: list[list[int]]) -> np.ndarray:
        """A host buffer (uint8, the layout up to the bucket's bs + 1 table rows) for n <= bs entries of the bucket bs: entry i forwards ids[i]
        (1..t tokens) from position positions[i] into slots[i]. The padding sequence n owns the rows past the
        entries' (slot -1, positions 0.., table of block 0); sequences n+1..bs own none."""
        n, t = len(ids), self.tokens_per_seq
        if n > bs or bs > self.max_batch:
            raise ValueError(f"{n} entries for batch bucket {bs} (at most {self.max_batch})")
        buf = np.zeros(self.nbytes, dtype=np.uint8)
        ids_v, pos_v, slots_v, lens_v, starts_v, table_v = self.views(buf)
        rows, row = bs * t, 0
        for i, (tokens, start, entry_slots, table) in enumerate(zip(ids, positions, slots, tables)):
            m = len(tokens)
            if not 1 <= m <= t or len(entry_slots) != m:
                raise ValueError(f"entry {i} forwards {m} tokens into {len(entry_slots)} slots (1..{t} allowed)")
            ids_v[row:row + m], slots_v[row:row + m] = tokens, entry_slots
            pos_v[row:row + m] = np.arange(start, start + m)
            lens_v[i], starts_v[i] = start + m, row
            table_v[i, :len(table)] = table
            row += m
        pad = rows - row
        slots_v[row:rows] = -1
        pos_v[row:rows] = np.arange(pad)
        lens_v[n], starts_v[n] = pad, row
        starts_v[n + 1:bs + 2] = rows                   # the padding sequence ends at the last row; the rest are empty
        return buf[:self.table_offset + 4 * (bs + 1) * self.max_blocks]


def step_entries(scheduled: list, block_size: int) -> list[tuple[list[int], int, list[int], list[int]]]:
    """scheduled: a verification step's ScheduledSeq entries. -> per entry (input tokens: its last known token, then
    its proposals; first position; KV slots of those tokens; block table)."""
    entries = []
    for item in scheduled:
        seq, n, p = item.seq, item.num_new_tokens, item.seq.num_computed_tokens
        tokens = seq.token_ids[p:p + n] + (list(seq.spec_token_ids) if item.num_spec_tokens else [])
        if len(tokens) != n:
            raise ValueError(f"sequence {seq.request_id}: {n} new tokens scheduled, {len(tokens)} on the host")
        slots = [seq.block_table[q // block_size] * block_size + q % block_size for q in range(p, p + n)]
        entries.append((tokens, p, slots, seq.block_table))
    return entries


def row_starts(entries: list) -> list[int]:
    """entries: step_entries'. -> [n + 1]: where each entry's rows start in the step, then the end."""
    starts = [0]
    for tokens, *_ in entries:
        starts.append(starts[-1] + len(tokens))
    return starts


class VerifyGraphs:
    def __init__(self, model, max_batch: int, tokens_per_seq: int, max_model_len: int, block_size: int,
                 device: torch.device):
        if tokens_per_seq < 2:
            raise ValueError(f"a verification forwards at least 2 tokens per sequence, got {tokens_per_seq}")
        self.model = model
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch, self.tokens_per_seq, self.block_size = max_batch, tokens_per_seq, block_size
        self.inputs = VerifyInputs(max_batch, tokens_per_seq, -(-max_model_len // block_size))
        self.blob = torch.zeros(self.inputs.nbytes, dtype=torch.uint8, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.query_start_loc, self.tables = \
            self.inputs.views(self.blob)
        self.slot_mapping.fill_(-1)                      # the capture's forwards store nothing
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}                         # batch bucket -> graph
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}         # (hidden, fp32 logits)
        # [max_batch * t, vocab] fp32, outside the graph pool: every bucket's graph writes its logits into its first
        # rows (one copy kernel), where an output of each graph's own would hold a buffer per bucket for good
        self.logits: torch.Tensor | None = None

    def _meta(self, bs: int) -> AttentionMetadata:
        rows = bs * self.tokens_per_seq
        return AttentionMetadata(slot_mapping=self.slot_mapping[:rows], block_tables=self.tables[:bs + 1],
                                 seq_lens=self.seq_lens[:bs + 1], query_start_loc=self.query_start_loc[:bs + 2],
                                 max_seq_len=self.inputs.max_blocks * self.block_size,
                                 max_query_len=self.tokens_per_seq, multi_token=True)

    def step(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph records: the forward of bucket bs over the static inputs and the head over every row.
        -> (hidden [bs * t, hidden], logits [bs * t, vocab] fp32: the first rows of self.logits). The first call,
        before any capture (the warm-up runs of the largest bucket), allocates self.logits."""
        rows = bs * self.tokens_per_seq
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], self._meta(bs))
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = torch.empty((self.inputs.max_rows, logits.shape[1]), dtype=logits.dtype,
                                      device=logits.device)
        self.logits[:rows].copy_(logits)
        return hidden, self.logits[:rows]

    @torch.inference_mode()
    def run_eagerly(self) -> None:
        """Every graph's step once, outside any capture (parallel_compile compiles their kernels this way)."""
        for bs in reversed(self.buckets):
            self._pack_idle(bs)
            self.step(bs)

    @torch.inference_mode()
    def capture(self, show_progress: bool = False, pool=None) -> None:
        """pool: the decode graphs' memory pool (they never run at the same time as these)."""
        for bs in tqdm(list(reversed(self.buckets)), desc="Capturing verify graphs", unit="graph",
                       disable=not show_progress):
            self._pack_idle(bs)
            self.graphs[bs], self.outputs[bs], pool = _capture(lambda: self.step(bs), pool)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for verification: batch sizes %s x %d tokens", len(self.graphs),
                    self.buckets, self.tokens_per_seq)

    def _pack_idle(self, bs: int) -> None:
        """Inputs of bucket bs with no entries (one padding sequence owns its bs * t rows), for its warm-up and
        capture forwards: they store nothing. Each bucket packs its own: the largest bucket's padding sequence
        runs past a smaller bucket's rows, and the attention kernel wrote past its output (illegal address)."""
        packed = self.inputs.pack(bs, [], [], [], [])
        self.blob[:packed.size].copy_(torch.from_numpy(packed))

    def can_run(self, num_tokens: list[int]) -> bool:
        """num_tokens: the scheduled entries' new tokens (each <= t, at most max_batch entries)."""
        return bool(self.graphs) and 0 < len(num_tokens) <= self.max_batch and max(num_tokens) <= self.tokens_per_seq

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def pack_step(self, scheduled: list) -> tuple[int, np.ndarray, list[int]]:
        """scheduled: the step's ScheduledSeq entries, every input token on the host (a speculating entry's: its
        last known token, then its proposals). -> (batch bucket, packed inputs for run, row starts [n + 1])."""
        entries = step_entries(scheduled, self.block_size)
        ids, positions, slots, tables = (list(column) for column in zip(*entries)) if entries else ([],) * 4
        bs = self.bucket_for(len(scheduled))
        return bs, self.inputs.pack(bs, ids, positions, slots, tables), row_starts(entries)

    def run(self, bs: int, packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays bucket bs over packed (pack_step). -> (hidden [bs * t, hidden], logits [bs * t, vocab] fp32):
        the graph's static outputs, valid until the next replay; rows past the entries' are padding."""
        host = torch.from_numpy(packed)
        if self.blob.is_cuda:           # pinned: the copy is queued (the caching host allocator keeps the buffer)
            host = host.pin_memory()
        self.blob[:host.shape[0]].copy_(host, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs]


class VerifyRowGraphs:
    """Verification steps as decode rows (see the module's docstring); the same interface as VerifyGraphs."""

    def __init__(self, model, max_batch: int, tokens_per_seq: int, max_model_len: int, block_size: int,
                 device: torch.device, num_kv_heads: int, kv_fp8: bool = False):
        self.model = model
        self.max_batch, self.tokens_per_seq, self.block_size = max_batch, tokens_per_seq, block_size
        self.rows = DecodeGraphs(model, max_batch * tokens_per_seq, max_model_len, block_size, device, num_kv_heads,
                                 kv_fp8, store_first=True, name="verification row")

    @property
    def graphs(self) -> dict:
        return self.rows.graphs

    @property
    def buckets(self) -> list[int]:
        """Row buckets (sequences x tokens)."""
        return self.rows.buckets

    def run_eagerly(self) -> None:
        self.rows.run_eagerly()

    def capture(self, show_progress: bool = False, pool=None) -> None:
        self.rows.capture(show_progress, pool)

    def can_run(self, num_tokens: list[int]) -> bool:
        return bool(self.graphs) and 0 < len(num_tokens) <= self.max_batch and max(num_tokens) <= self.tokens_per_seq

    def pack_step(self, scheduled: list) -> tuple[tuple[int, tuple[int, int]], np.ndarray, list[int]]:
        """As VerifyGraphs.pack_step: -> ((rows, graph shape), packed DecodeInputs, row starts [n + 1])."""
        entries = step_entries(scheduled, self.block_size)
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for tokens, p, entry_slots, table in entries:
            n = len(tokens)
            ids += tokens
            positions += range(p, p + n)
            slots += entry_slots
            seq_lens += range(p + 1, p + n + 1)
            tables += [table] * n
        shape = self.rows.shape_for(len(ids), max(len(t) for t in tables))
        packed = self.rows.inputs.pack(*shape, ids, positions, slots, seq_lens, tables, [-1] * len(ids))
        return (len(ids), shape), packed, row_starts(entries)

    def run(self, key: tuple[int, tuple[int, int]], packed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [rows, hidden], logits [rows, vocab] fp32) of the real rows."""
        rows, shape = key
        hidden, _ = self.rows.run(rows, shape, packed)
        return hidden, self.model.compute_logits(hidden)
