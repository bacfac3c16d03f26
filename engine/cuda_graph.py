"""CUDA graphs for decode steps: one graph per bucketed batch size (and, for small batches, per block-table width),
captured once at start, replayed each step.

A decode step (one new token per sequence) launches a few hundred small kernels; replaying a captured graph
removes their launch overhead. Inputs are copied into static buffers; rows past the real batch are padding
(slot -1: nothing is stored; their outputs are dropped). Where the decode attention splits contexts finely (few
programs: kernels/paged_attention.decode_graph_contexts), a batch bucket has a graph per table width (1024, 2048,
... tokens up to max_model_len, where the decode launch differs) and a step replays the narrowest that holds its
longest context."""
import logging

import torch

from engine.attention import AttentionMetadata
from kernels.paged_attention import FEW_PROGRAMS, decode_graph_contexts

logger = logging.getLogger("quant_serve")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
                 num_kv_heads: int, kv_fp8: bool = False):
        self.model = model
        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        max_blocks = -(-max_model_len // block_size)
        # table widths in blocks per batch bucket, narrowest first; many programs: one wide table (AttentionMetadata)
        self.widths = {bs: sorted({-(-t // block_size) for t in decode_graph_contexts(
            bs * num_kv_heads, max_blocks * block_size, kv_fp8, torch.device(device))}) for bs in self.buckets}
        self.wide = {bs: bs * num_kv_heads > FEW_PROGRAMS for bs in self.buckets}
        self.block_size = block_size
        with torch.device(device):
            self.input_ids = torch.zeros(max_batch, dtype=torch.long)
            self.positions = torch.zeros(max_batch, dtype=torch.long)
            self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long)
            self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32)
            self.seq_lens = torch.ones(max_batch, dtype=torch.int32)
            self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32)
        self.max_model_len = max_model_len
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}      # (batch bucket, width in blocks)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _meta(self, bs: int, width: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs, :width],
                                 seq_lens=self.seq_lens[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                 max_seq_len=width * self.block_size, max_query_len=1,
                                 wide_table=self.wide[bs])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):       # largest first: smaller graphs reuse its memory pool
            for width in reversed(self.widths[bs]):
                args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs, width))
                for _ in range(2):              # compile/autotune outside the capture
                    self.model(*args)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs, width] = self.model(*args)
                pool = graph.pool()
                self.graphs[bs, width] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s", len(self.graphs), self.buckets)

    def can_run(self, num_seqs: int, num_tokens: int) -> bool:
        return num_tokens == num_seqs <= self.max_batch and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Decode batch of n sequences (one token each) -> hidden [n, hidden]."""
        n = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= n)
        width = meta.block_tables.shape[1]
        graph_width = next(w for w in self.widths[bs] if w >= width)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs, graph_width].replay()
        return self.outputs[bs, graph_width][:n]
