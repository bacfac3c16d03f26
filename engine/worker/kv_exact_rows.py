"""Host bookkeeping of the integer KV cache's exact window (kernels/attention/kv_exact.py): which ring row each
sequence owns and which of its positions the ring holds, turned into each step's ExactRows.

A sequence keeps its row while it runs, is swapped out or waits after a preemption; rows go least recently used
first to the sequences that need one (max_num_seqs rows: one for every sequence a step can schedule, plus a spare
row that takes the writes nobody will read). A row's slots are written only by its own sequence's steps, so
what the ring held stays valid across swaps. A sequence that lost its row, hit the prefix cache or rolled back
(preemption by recompute, rejected proposals) reads quantized keys until its new tokens fill the ring again.
"""
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from quant_serve.engine.worker.transfer import to_device
from quant_serve.kernels.attention.kv_exact import ExactRows

logger = logging.getLogger("quant_serve")


@dataclass
class _RowState:
    seq: object       # the Sequence (identity check: an id() may be reused once a sequence is gone)
    row: int
    lo: int = 0       # the ring holds positions [lo, hi) of this sequence
    hi: int = 0


class ExactRowTable:
    def __init__(self, num_rows: int, size: int, device: torch.device):
        self.size = size
        self.spare = num_rows                       # the ring tensors have num_rows + 1 rows
        self.device = device
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: OrderedDict[int, _RowState] = OrderedDict()      # id(seq) -> state, least recently used first

    def _state(self, seq, in_step: set[int]) -> _RowState:
        st = self._rows.get(id(seq))
        if st is not None and st.seq is seq:
            self._rows.move_to_end(id(seq))
            return st
        if st is not None:                          # a gone sequence's id reused: its row is free again
            self._free.append(self._rows.pop(id(seq)).row)
        if not self._free:
            victim = next((key for key in self._rows if key not in in_step), None)
            if victim is None:
                raise RuntimeError(f"exact window: more than {self.spare} sequences in one step")
            self._free.append(self._rows.pop(victim).row)
        st = self._rows[id(seq)] = _RowState(seq, self._free.pop())
        return st

    def step_lists(self, entries) -> tuple[list[int], list[int], list[int], list[int]]:
        """(seq, num_new_tokens) of each scheduled entry -> the step's (ring rows, lo, hi, flat slots) as lists;
        advances the bookkeeping as if the step ran (the ring is written inside the forward)."""
        in_step = {id(seq) for seq, _ in entries}
        size = self.size
        rows, lo, hi, slots = [], [], [], []
        for seq, n in entries:
            st = self._state(seq, in_step)
            start = seq.num_computed_tokens
            end = start + n
            rows.append(st.row)
            lo.append(max(st.lo, start - size))
            hi.append(min(st.hi, start))
            keep = end - size                       # only the last `size` new tokens go to the row
            slots += [(st.row if p >= keep else self.spare) * size + p % size for p in range(start, end)]
            st.lo = max(st.lo if st.hi >= start else start, end - size)
            st.hi = end
        return rows, lo, hi, slots

    def step(self, scheduled) -> ExactRows:
        """An eager step's ExactRows (scheduled: the SchedulerOutput's entries)."""
        rows, lo, hi, slots = self.step_lists([(item.seq, item.num_new_tokens) for item in scheduled])
        return ExactRows(ring_row=to_device(rows, torch.int32, self.device),
                         ring_lo=to_device(lo, torch.int32, self.device),
                         ring_hi=to_device(hi, torch.int32, self.device),
                         ring_slot=to_device(slots, torch.int64, self.device))


def exact_window_start(config, device: str) -> int:
    """The exact window (tokens) an engine of this config runs with. Decode steps keep their CUDA graphs (the ring
    rows travel in the graphs' inputs); verification steps run eagerly: a verification graph's rows of one sequence
    would each read the others' new K/V quantized (engine/worker/startup.py)."""
    from quant_serve.kernels.attention.kv_int import int_kv_exact_tokens
    tokens = int_kv_exact_tokens(config.cache.kv_cache_dtype, config.cache.kv_exact_tokens)
    if tokens and device != "cpu" and config.speculative.enabled and not config.enforce_eager:
        logger.info("--kv-cache-dtype %s with a %d-token exact window: verification steps run eagerly",
                    config.cache.kv_cache_dtype, tokens)
    return tokens
