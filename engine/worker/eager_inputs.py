"""The flat batch tensors of an eager forward (ModelRunner.prepare_forward), from a SchedulerOutput."""
import numpy as np
import torch

from quant_serve.engine.worker.attention import AttentionMetadata
from quant_serve.engine.core.scheduler import SchedulerOutput
from quant_serve.engine.worker.transfer import to_device


def padded_rows(tables: list[list[int]]) -> np.ndarray:
    """Block tables -> int32 [B, longest], padded with 0 (row fills: 4x faster than nested lists to a tensor)."""
    rows = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in zip(rows, tables):
        row[:len(table)] = table
    return rows


def eager_inputs(out: SchedulerOutput, carry_rows: dict[int, int] | None, block_size: int, device: torch.device):
    """The flat inputs of an eager forward: (input_ids, positions, attention metadata, row starts, fill), with
    fill = (input positions, rows of the carried samples) for the inputs the step in flight samples, or None."""
    input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    tables = []
    fill_at, fill_from = [], []        # input positions whose token the step in flight samples: its row
    bs = block_size
    for item in out.scheduled:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        # a speculating entry: its last known token, then its proposals (no copy of the whole context)
        known = seq.token_ids[start:start + n] + seq.spec_token_ids if item.num_spec_tokens else \
            seq.token_ids[start:start + n]
        assert len(known) <= n, (seq.request_id, len(known), n)
        if len(known) < n:             # the last input is the sequence's pending token
            fill_at.append(len(input_ids) + len(known))
            fill_from.append(carry_rows[id(seq)])
            known = known + [0]
        input_ids += known
        positions += range(start, start + n)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        seq_lens.append(start + n)
        starts.append(starts[-1] + n)
        tables.append(seq.block_table)
    table_rows = padded_rows(tables)

    def tensor(values, dtype):
        return to_device(values, dtype, device)

    num_decodes = 0                     # leading sequences with one new token (running decodes come first)
    while num_decodes < len(out.scheduled) and out.scheduled[num_decodes].num_new_tokens == 1:
        num_decodes += 1
    mixed = 0 < num_decodes < len(out.scheduled)
    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64), block_tables=tensor(table_rows, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32), query_start_loc=tensor(starts, torch.int32),
        max_seq_len=max(seq_lens), max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        num_decodes=num_decodes if mixed else 0,
        prefill_query_start_loc=tensor([s - num_decodes for s in starts[num_decodes:]], torch.int32)
        if mixed else None)
    # the inputs that the step in flight samples are gathered on the device when the forward runs, behind it
    fill = (tensor(fill_at, torch.int64), tensor(fill_from, torch.int64)) if fill_at else None
    return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta, starts, fill
