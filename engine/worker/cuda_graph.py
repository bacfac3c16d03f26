"""CUDA graphs for decode steps: one graph per bucketed batch size (and, for small batches, per block-table width),
captured once at start, replayed each step.

A decode step (one new token per sequence) launches a few hundred small kernels; replaying a captured graph
removes their launch overhead. Inputs are copied into static buffers; rows past the real batch are padding
(slot -1: nothing is stored; their outputs are dropped). Where the decode attention splits contexts finely (few
programs: kernels/attention/paged.decode_graph_contexts), a batch bucket has a graph per table width (1024, 2048,
... tokens up to max_model_len, where the decode launch differs) and a step replays the narrowest that holds its
longest context.

A step's inputs reach the graph as one packed host buffer and one copy (DecodeInputs): the graphs read their
static inputs as views of one device blob, so a step queues a copy, the carried-token gather (when the step in
flight samples its inputs) and the replay, not a dozen small copies and fills."""
import logging
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from quant_serve.engine.worker.attention import AttentionMetadata
from quant_serve.kernels.argmax import argmax_rows
from quant_serve.kernels.attention.kv_exact import ExactRows
from quant_serve.kernels.attention.paged import FEW_PROGRAMS, decode_graph_contexts
from quant_serve.kernels.step_inputs import take_carried

logger = logging.getLogger("quant_serve")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Batches up to this also get a greedy graph (the head and the argmax inside): a step's launches and their gaps
# outside the graph weigh most where the step is shortest.
GREEDY_MAX_BATCH = 8


@dataclass
class DecodeInputs:
    """Byte layout of a decode step's inputs, the same on the host and in the device blob: columns of [max_batch]
    rows, the int64 ones first (so every view is aligned): input ids, positions, slots, carry rows (the row of the
    step in flight's samples that holds the input id, -1: the id is known), with an exact window the ring slots;
    then int32 seq_lens, with LoRA each row's adapter slot (-1: the base), with an exact window the ring rows,
    lo and hi (kernels/attention/kv_exact.py); then the block table, [bs, width] contiguous for the graph of batch
    bucket bs and width `width` (each graph reads its own shape of the same bytes)."""
    max_batch: int
    max_blocks: int
    exact: bool = False
    lora: bool = False

    @property
    def columns(self) -> list[tuple[str, int]]:
        return [("ids", 8), ("positions", 8), ("slots", 8), ("carry_rows", 8)] \
            + [("ring_slot", 8)] * self.exact + [("seq_lens", 4)] + [("lora_slots", 4)] * self.lora \
            + [("ring_row", 4), ("ring_lo", 4), ("ring_hi", 4)] * self.exact

    def _column_views(self, blob) -> dict:
        views, at, mb = {}, 0, self.max_batch
        for name, size in self.columns:
            views[name] = blob[at: at + size * mb].view(_dtype(blob, size))
            at += size * mb
        return views

    @property
    def table_offset(self) -> int:
        return sum(size for _, size in self.columns) * self.max_batch

    @property
    def nbytes(self) -> int:
        return self.table_offset + 4 * self.max_batch * self.max_blocks

    def views(self, blob):
        """blob (uint8, torch or numpy) -> (ids, positions, slots, carry_rows, seq_lens, tables flat)."""
        v = self._column_views(blob)
        return (v["ids"], v["positions"], v["slots"], v["carry_rows"], v["seq_lens"],
                blob[self.table_offset: self.nbytes].view(_dtype(blob, 4)))

    def exact_views(self, blob):
        """With exact: (ring rows, ring lo, ring hi, ring slots) [max_batch]."""
        v = self._column_views(blob)
        return v["ring_row"], v["ring_lo"], v["ring_hi"], v["ring_slot"]

    def lora_view(self, blob):
        """With lora: each row's adapter slot [max_batch] int32."""
        return self._column_views(blob)["lora_slots"]

    def pack(self, bs: int, width: int, ids: list[int], positions: list[int], slots: list[int],
             seq_lens: list[int], tables: list[list[int]], carry_rows: list[int],
             exact: tuple | None = None, lora_slots: list[int] | None = None) -> np.ndarray:
        """A host buffer (uint8, the layout's first bytes up to bs x width of table) for n <= bs sequences; rows n..bs
        pad: slot -1 (stores nothing), length 1, table of block 0, id known (0), no adapter. exact: (ring rows, lo,
        hi, slots, spare row, window size): padding rows write to the spare row and read no ring. lora_slots: None
        when no row has an adapter."""
        n = len(ids)
        buf = np.zeros(self.table_offset + 4 * bs * width, dtype=np.uint8)
        ids_v, pos_v, slots_v, carry_v, lens_v, table_v = self.views(buf)
        ids_v[:n], pos_v[:n], slots_v[:n], carry_v[:n], lens_v[:n] = ids, positions, slots, carry_rows, seq_lens
        slots_v[n:bs], carry_v[n:bs], lens_v[n:bs] = -1, -1, 1
        if exact is not None:
            row_v, lo_v, hi_v, ring_v = self.exact_views(buf)
            row_v[:n], lo_v[:n], hi_v[:n], ring_v[:n] = exact[:4]
            row_v[n:bs], ring_v[n:bs] = exact[4], exact[4] * exact[5]
        if self.lora:
            lora_v = self.lora_view(buf)
            lora_v[:bs] = -1
            if lora_slots is not None:
                lora_v[:n] = lora_slots
        rows = table_v.reshape(bs, width)
        for row, table in zip(rows, tables):
            row[:len(table)] = table
        return buf


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                 num_kv_heads: int, kv_fp8: bool = False, store_first: bool = False, name: str = "decode",
                 exact=None, lora=None):
        """store_first: rows of one sequence side by side (verification rows, engine/spec/graphs.py): K/V stored
        before the decode kernel, not inside it, and no greedy graphs (all logits are taken). exact: an integer
        cache's exact window (engine/worker/kv_exact_rows.ExactRowTable), whose ring rows each step packs. lora:
        the engine's LoRAManager: each row's adapter slot is an input, and the graphs always run the adapters'
        kernels (rows of the base skip them)."""
        self.model = model
        self.store_first, self.name = store_first, name
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        max_blocks = -(-max_model_len // block_size)
        # table widths in blocks per batch bucket, narrowest first; many programs: one wide table (AttentionMetadata)
        self.widths = {bs: sorted({-(-t // block_size) for t in decode_graph_contexts(
            bs * num_kv_heads, max_blocks * block_size, kv_fp8, torch.device(device))}) for bs in self.buckets}
        self.wide = {bs: bs * num_kv_heads > FEW_PROGRAMS for bs in self.buckets}
        self.block_size = block_size
        self.inputs = DecodeInputs(max_batch, max_blocks, exact is not None, lora is not None)
        self.blob = torch.zeros(self.inputs.nbytes, dtype=torch.uint8, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.carry_rows, self.seq_lens, self.tables = \
            self.inputs.views(self.blob)
        self.lora, self.lora_slots = lora, None
        if lora is not None:
            self.lora_slots = self.inputs.lora_view(self.blob)
            self.lora_slots.fill_(-1)
        self.exact, self.exact_rows = exact, None
        if exact is not None:               # the capture's forwards write the spare row and read no ring
            self.exact_rows = ExactRows(*self.inputs.exact_views(self.blob))
            self.exact_rows.ring_row.fill_(exact.spare)
            self.exact_rows.ring_slot.fill_(exact.spare * exact.size)
        self.slot_mapping.fill_(-1)                      # the capture's forwards store nothing
        self.carry_rows.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}      # (batch bucket, width in blocks)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.greedy: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}       # same keys, bs <= GREEDY_MAX_BATCH
        self.greedy_outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}   # (hidden, token ids)
        self.pool = None                 # the graphs' memory pool, once captured (the verify graphs share it)

    def _meta(self, bs: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.tables[:bs * width].view(bs, width),
                                 seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                 max_seq_len=width * self.block_size, max_query_len=1,
                                 wide_table=self.wide[bs], store_first=self.store_first,
                                 exact_rows=None if self.exact_rows is None else ExactRows(
                                     *(t[:bs] for t in (self.exact_rows.ring_row, self.exact_rows.ring_lo,
                                                        self.exact_rows.ring_hi, self.exact_rows.ring_slot))))

    def step_args(self, bs: int, width: int) -> tuple:
        """The model's arguments for the graph (bs, width): static views (and, with LoRA, the adapters' rows)."""
        if self.lora is not None:       # what the LoRA layers read while the graph is captured (or run eagerly)
            self.lora.batch.slots = self.lora_slots[:bs]
        return self.input_ids[:bs], self.positions[:bs], self._meta(bs, width)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(batch bucket, table width) of every graph, largest first: smaller graphs reuse its memory pool."""
        return [(bs, width) for bs in reversed(self.buckets) for width in reversed(self.widths[bs])]

    @torch.inference_mode()
    def run_eagerly(self) -> None:
        """Every graph's step once, outside any capture (parallel_compile compiles their kernels this way)."""
        for bs, width in self.shapes:
            args = self.step_args(bs, width)
            self.model(*args)
            if bs <= GREEDY_MAX_BATCH and not self.store_first:
                self._greedy_step(args)
        for bs in self.buckets:
            take_carried(self.input_ids[:bs], self.carry_rows[:bs], self.input_ids)
        self._release_lora_rows()

    def _release_lora_rows(self) -> None:
        """The LoRA layers stop reading the graphs' rows: an eager forward after capture (warm-up, a prefill) sets
        its own or runs the base."""
        if self.lora is not None:
            self.lora.batch.slots = None

    @torch.inference_mode()
    def capture(self, show_progress: bool = False, pool=None) -> None:
        """pool: another set of graphs' memory pool to share (they never run at the same time)."""
        for bs, width in tqdm(self.shapes, desc=f"Capturing {self.name} graphs", unit="graph",
                              disable=not show_progress):
            args = self.step_args(bs, width)
            self.graphs[bs, width], self.outputs[bs, width], pool = _capture(lambda: self.model(*args), pool)
            if bs <= GREEDY_MAX_BATCH and not self.store_first:
                self.greedy[bs, width], self.greedy_outputs[bs, width], pool = _capture(
                    lambda: self._greedy_step(args), pool)
        for bs in self.buckets:                 # the carried-token gather, every BLOCK it takes (rows: all -1)
            take_carried(self.input_ids[:bs], self.carry_rows[:bs], self.input_ids)
        self.pool = pool
        self._release_lora_rows()
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for %s batch sizes %s (%d greedy)", len(self.graphs), self.name,
                    self.buckets, len(self.greedy))

    def _greedy_step(self, args) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step and the argmax of its logits (in the model's dtype, as Sampler takes it)."""
        hidden = self.model(*args)
        return hidden, argmax_rows(self.model.compute_logits(hidden, float32=False))

    def can_run(self, num_seqs: int, num_tokens: int) -> bool:
        return num_tokens == num_seqs <= self.max_batch and bool(self.graphs)

    def pack_step(self, seqs: list, carry_rows: dict[int, int] | None) -> tuple[tuple[int, int], np.ndarray, bool]:
        """A decode step of seqs (one new token each) -> (graph shape, packed inputs for run, whether a token is
        carried). carry_rows: id(sequence) -> its row in the samples of the step in flight, for sequences whose
        input token that step has not yet returned."""
        ids, positions, slots, seq_lens, tables, rows = [], [], [], [], [], []
        bs = self.block_size
        for seq in seqs:
            p = seq.num_computed_tokens
            known = p < len(seq.token_ids)
            ids.append(seq.token_ids[p] if known else 0)
            rows.append(-1 if known else carry_rows[id(seq)])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            seq_lens.append(p + 1)
            tables.append(seq.block_table)
        shape = self.shape_for(len(ids), max(len(t) for t in tables))
        entries = [(seq, 1) for seq in seqs]
        exact = None if self.exact is None else (*self.exact.step_lists(entries), self.exact.spare, self.exact.size)
        adapters = None if self.lora is None else self.lora.step_rows(entries)
        return shape, self.inputs.pack(*shape, ids, positions, slots, seq_lens, tables, rows, exact, adapters), \
            max(rows) >= 0

    def shape_for(self, num_seqs: int, table_blocks: int) -> tuple[int, int]:
        """The (batch bucket, table width in blocks) of the graph that runs num_seqs sequences whose longest block
        table has table_blocks blocks."""
        bs = next(b for b in self.buckets if b >= num_seqs)
        return bs, next(w for w in self.widths[bs] if w >= table_blocks)

    def run(self, n: int, shape: tuple[int, int], packed: np.ndarray, carried: torch.Tensor | None = None,
            greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode batch of n sequences (one token each) -> (hidden [n, hidden], the argmax token of each row [n] where
        greedy and a greedy graph has the shape, else None). packed: DecodeInputs.pack for the graph `shape`
        (shape_for); carried: the samples of the step in flight that carry rows index (on the device)."""
        host = torch.from_numpy(packed)
        if self.blob.is_cuda:           # pinned: the copy is queued (the caching host allocator keeps the buffer)
            host = host.pin_memory()
        self.blob[:host.shape[0]].copy_(host, non_blocking=True)
        if carried is not None:             # over the bucket (padding rows carry nothing): its BLOCK was warmed up
            take_carried(self.input_ids[:shape[0]], self.carry_rows[:shape[0]], carried)
        if greedy and shape in self.greedy:
            self.greedy[shape].replay()
            hidden, ids = self.greedy_outputs[shape]
            return hidden[:n], ids[:n]
        self.graphs[shape].replay()
        return self.outputs[shape][:n], None


def _capture(step, pool):
    """(graph, its outputs, the memory pool) of step(), run twice first (compiles and autotunes outside the
    capture); graphs share one pool, largest first (they never run at the same time)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs, graph.pool()


def _dtype(blob, size: int):
    """The int dtype of `size` bytes in blob's library (torch or numpy)."""
    if isinstance(blob, torch.Tensor):
        return torch.int64 if size == 8 else torch.int32
    return np.int64 if size == 8 else np.int32
