"""The integer KV cache's exact window in the engine: the ring-row bookkeeping (engine/worker/kv_exact_rows.py)
with exact rows, slots and ranges, and an engine whose window covers the whole context scoring and decoding as
the unquantized cache does (every key read exact: new tokens, earlier chunks and earlier steps from the ring)."""
from types import SimpleNamespace

import pytest
import torch

from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.worker.kv_exact_rows import ExactRowTable
from helpers import make_engine


def _seq(computed: int):
    return SimpleNamespace(num_computed_tokens=computed)


def _step(table, *entries):
    rows = table.step([SimpleNamespace(seq=seq, num_new_tokens=n) for seq, n in entries])
    return rows.ring_row.tolist(), rows.ring_lo.tolist(), rows.ring_hi.tolist(), rows.ring_slot.tolist()


def test_rows_ranges_and_slots():
    table = ExactRowTable(num_rows=2, size=4, device="cpu")            # rows 0, 1; spare row 2
    a, b, c = _seq(0), _seq(0), _seq(0)
    # a prefill of 6: nothing in the ring yet; only its last 4 tokens go to row 0, the first 2 to the spare row
    assert _step(table, (a, 6)) == ([0], [0], [0], [2 * 4 + 0, 2 * 4 + 1, 2, 3, 0, 1])
    a.num_computed_tokens = 6
    assert _step(table, (a, 1), (b, 3)) == ([0, 1], [2, 0], [6, 0], [2, 4 + 0, 4 + 1, 4 + 2])
    a.num_computed_tokens, b.num_computed_tokens = 7, 3
    # a verification of two proposals (positions 7..9) writes slots 3, 0, 1; both proposals rejected: a rolls back
    # to 8 tokens, and of what the ring holds (6..9) only 6 and 7 are a's tokens now
    assert _step(table, (a, 3)) == ([0], [3], [7], [3, 0, 1])
    a.num_computed_tokens = 8
    assert _step(table, (a, 1)) == ([0], [6], [8], [0])
    # c needs a row: b (least recently used, not in this step) gives up row 1; b then starts over on row 1 ...
    assert _step(table, (c, 2), (a, 1))[0] == [1, 0]
    c.num_computed_tokens, a.num_computed_tokens = 2, 9
    assert _step(table, (b, 1)) == ([1], [0], [0], [4 + 3])               # ... with an empty ring range
    with pytest.raises(RuntimeError, match="more than 2 sequences in one step"):
        table.step([SimpleNamespace(seq=s, num_new_tokens=1) for s in (a, b, c)])


def test_lost_row_and_prefix_hit_read_no_stale_ring():
    table = ExactRowTable(num_rows=1, size=4, device="cpu")
    a, b = _seq(0), _seq(0)
    _step(table, (a, 5))
    b.num_computed_tokens = 16                                            # a prefix-cache hit: nothing of b's in a ring
    assert _step(table, (b, 2)) == ([0], [12], [0], [0, 1])               # row 0 taken from a: empty range
    a.num_computed_tokens = 5
    assert _step(table, (a, 1)) == ([0], [1], [0], [1])                   # a lost its row: empty range again
    a.num_computed_tokens = 6
    assert _step(table, (a, 1))[1:3] == ([5], [6])                        # the ring refills from its new tokens


@pytest.mark.parametrize("chunk", [2048, 8], ids=["one prefill", "chunked prefill"])
def test_window_over_the_whole_context_is_the_unquantized_cache(trained_model, chunk):
    """kv_exact_tokens >= the context: every key is read exact, so int4 scores and decodes as the float cache (the
    window off, the same engine differs: the test sees the window)."""
    prompt = list(range(40, 70))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    ref = make_engine(trained_model, chunk=chunk, max_model_len=128)
    want_scores = ref.score(prompt)
    want = ref.generate([prompt], params)[0].outputs[0]
    for exact, same in ((64, True), (0, False)):
        engine = make_engine(trained_model, chunk=chunk, max_model_len=128, kv_cache_dtype="int4",
                             kv_exact_tokens=exact)
        scores = engine.score(prompt)
        got = engine.generate([prompt], params)[0].outputs[0]
        close = torch.allclose(scores, want_scores, atol=1e-3)
        lp_close = all(abs(x.logprob - y.logprob) < 1e-3 for x, y in zip(got.logprobs, want.logprobs))
        assert close == same and (got.token_ids == want.token_ids and lp_close) == same, (exact, close)


def test_rings_take_what_the_plan_counts(trained_model):
    """The engine's rings (max_num_seqs + 1 rows of the window, K and V, every layer) are the plan's
    exact_window_bytes for the same model and max_num_seqs."""
    from quant_serve.engine.plan.memory import plan_memory
    engine = make_engine(trained_model, max_model_len=128, kv_cache_dtype="int4", max_num_seqs=6, dtype="float16")
    rings = [t for layer in engine.model.attention_layers for t in layer.kv_rings]
    plan = plan_memory(trained_model, gpu_mem_gb=24, kv_cache_dtype="int4", max_model_len=128, max_num_seqs=6)
    assert sum(t.numel() * t.element_size() for t in rings) == plan.exact_window_bytes > 0
    assert rings[0].shape[:2] == (7, 24) and engine.runner.exact_rows.spare == 6
