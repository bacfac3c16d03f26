"""Scheduler: one token budget, decode-first order, chunked prefill, preemption, abort and stop conditions."""
import pytest

from quant_serve.engine.core.block_manager import BlockManager
from quant_serve.engine.config import SchedulerConfig
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.scheduler import Scheduler, SchedulerOutput
from quant_serve.engine.core.sequence import Sequence, SequenceStatus

TOKEN = 50          # what the fake model samples unless told otherwise


@pytest.fixture
def new_sched():
    made = []

    def make(num_blocks=64, block_size=4, prefix_caching=True, **cfg) -> Scheduler:
        cfg.setdefault("max_num_batched_tokens", 64)
        bm = BlockManager(num_blocks, block_size, prefix_caching)
        sched = Scheduler(SchedulerConfig(**cfg), bm)
        made.append(sched)
        return sched

    yield make
    for sched in made:     # every test ends with all requests finished or aborted
        bm = sched.block_manager
        assert not sched.has_unfinished()
        assert bm.num_free_blocks == bm.num_blocks and all(b.ref_cnt == 0 for b in bm.blocks)


def add(sched, rid, prompt, eos=(), **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    seq = Sequence(rid, list(prompt), SamplingParams(**params), eos_token_ids=tuple(eos))
    sched.add_sequence(seq)
    return seq


def step(sched, token=TOKEN) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = [token if s.sample else None for s in out.scheduled]
    return out, sched.postprocess(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def run_to_end(sched, token=TOKEN, max_steps=200) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, token)
    raise AssertionError("requests did not finish")


def test_decode_first_then_admit(new_sched):
    sched = new_sched()
    a = add(sched, "a", range(5))
    out, _ = step(sched)
    assert plan(out) == [("a", 5)] and out.num_batched_tokens == 5
    assert a.status == SequenceStatus.RUNNING and a.token_ids[-1] == TOKEN and a.num_computed_tokens == 5
    b = add(sched, "b", range(100, 107))
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 7)] and out.num_batched_tokens == 8
    assert [s.sample for s in out.scheduled] == [True, True]
    assert sched.running == [a, b]
    for seq in (a, b):
        sched.abort(seq.request_id)


def test_token_budget_chunks_prefill(new_sched):
    sched = new_sched(block_size=16, max_num_batched_tokens=32)
    a, b = add(sched, "a", range(50), max_tokens=3), add(sched, "b", range(100, 150), max_tokens=3)
    steps = []
    for _ in range(4):
        out, _ = step(sched)
        steps.append((plan(out), [s.sample for s in out.scheduled], out.num_batched_tokens))
        if len(steps) == 2:
            assert (a.block_table, b.block_table) == ([0, 1, 2, 3], [4])
            assert (a.num_computed_tokens, b.num_computed_tokens) == (50, 14)
    assert steps == [
        ([("a", 32)], [False], 32),
        ([("a", 18), ("b", 14)], [True, False], 32),
        ([("a", 1), ("b", 31)], [True, False], 32),
        ([("a", 1), ("b", 5)], [True, True], 6),
    ]
    assert a.is_finished and b.block_table == [4, 5, 6, 7]
    run_to_end(sched)
    assert a.output_token_ids == [TOKEN] * 3 and b.output_token_ids == [TOKEN] * 3


def test_no_chunking_waits_for_whole_prompt(new_sched):
    sched = new_sched(max_num_batched_tokens=64, enable_chunked_prefill=False)
    add(sched, "a", range(50), max_tokens=2)
    add(sched, "b", range(100, 120), max_tokens=2)
    out, _ = step(sched)
    assert plan(out) == [("a", 50)]          # b would only get 14 of its 20 tokens
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 20)]
    run_to_end(sched)


def test_max_num_seqs_cap(new_sched):
    sched = new_sched(max_num_seqs=2)
    add(sched, "a", range(4), max_tokens=1)
    add(sched, "b", range(4), max_tokens=3)
    add(sched, "c", range(4), max_tokens=1)
    out, finished = step(sched)
    assert plan(out) == [("a", 4), ("b", 4)] and [s.request_id for s in finished] == ["a"]
    out, _ = step(sched)
    assert plan(out) == [("b", 1), ("c", 4)]
    run_to_end(sched)


def test_preempts_newest_and_readmits_by_recompute(new_sched):
    sched = new_sched(num_blocks=4, block_size=4)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=2)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=3)
    c = add(sched, "c", [9, 10, 11, 12], max_tokens=3)
    out, _ = step(sched)
    assert [s.block_table for s in (a, b, c)] == [[0], [1], [2]]

    # a takes the last free block; b finds none, so c (the newest) is preempted and b reuses its block.
    out, finished = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == [c]
    assert b.block_table == [1, 2]
    assert c.status == SequenceStatus.WAITING and list(sched.waiting) == [c] and sched.running == [b]
    assert (c.block_table, c.num_computed_tokens, c.num_preemptions, sched.num_preemptions_total) == ([], 0, 1, 1)
    assert finished == [a] and a.finish_reason == "length"

    # c comes back with its output token: all 5 tokens are recomputed (its cached block was reused by b).
    out, _ = step(sched)
    assert plan(out) == [("b", 1), ("c", 5)] and out.preempted == []
    assert c.block_table == [3, 0] and c.num_cached_tokens == 0
    assert c.token_ids == [9, 10, 11, 12, TOKEN, TOKEN] and c.num_computed_tokens == 5
    run_to_end(sched)
    assert c.output_token_ids == [TOKEN] * 3


def test_preemptions_keep_older_first_in_waiting(new_sched):
    sched = new_sched(num_blocks=4, block_size=4)
    seqs = [add(sched, rid, range(i * 10, i * 10 + 4), max_tokens=3) for i, rid in enumerate("abcd")]
    step(sched)
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)] and [s.request_id for s in out.preempted] == ["d", "c"]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    assert (seqs[0].block_table, seqs[1].block_table) == ([0, 3], [1, 2])
    run_to_end(sched)
    assert all(s.finish_reason == "length" and s.num_output_tokens == 3 for s in seqs)


def test_preempts_itself_when_it_is_the_newest(new_sched):
    sched = new_sched(num_blocks=2, block_size=4)
    a = add(sched, "a", [1, 2, 3], max_tokens=2)
    b = add(sched, "b", [4, 5, 6, 7], max_tokens=3)
    step(sched)
    out, _ = step(sched)                     # a writes position 3 into its block; b needs a second block
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert b.num_preemptions == 1 and list(sched.waiting) == [b]
    # b's own block stayed cached: readmission hits it, so only the last token is recomputed.
    out, _ = step(sched)
    assert plan(out) == [("b", 1)] and b.num_cached_tokens == 4 and b.block_table == [1, 0]
    run_to_end(sched)
    assert a.output_token_ids == [TOKEN] * 2 and b.output_token_ids == [TOKEN] * 3


def test_prefix_hit_through_scheduler(new_sched):
    sched = new_sched(num_blocks=16, block_size=4)
    system = list(range(1000, 1008))
    a = add(sched, "a", system + [1, 2, 3], max_tokens=4)
    step(sched)
    b = add(sched, "b", system + [7, 8], max_tokens=2)
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2] == [0, 1]
    bm = sched.block_manager
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)
    run_to_end(sched)


def test_abort_from_waiting_and_running(new_sched):
    sched = new_sched(num_blocks=8, max_num_seqs=1)
    a = add(sched, "a", range(6))
    b = add(sched, "b", range(6))
    step(sched)
    assert a.block_table == [0, 1] and sched.block_manager.num_free_blocks == 6
    assert sched.abort("b") is b and list(sched.waiting) == []
    assert (b.status, b.finish_reason) == (SequenceStatus.FINISHED, "abort")
    assert sched.abort("a") is a and sched.running == [] and a.block_table == []
    assert (a.status, a.finish_reason) == (SequenceStatus.FINISHED, "abort")
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert sched.schedule().is_empty


def test_abort_between_schedule_and_postprocess(new_sched):
    sched = new_sched()
    a = add(sched, "a", range(5))
    out = sched.schedule()
    sched.abort("a")
    assert sched.postprocess(out, [TOKEN]) == []
    assert a.token_ids == list(range(5)) and a.finish_reason == "abort"


def test_finish_for_stop_string(new_sched):
    sched = new_sched()
    a = add(sched, "a", range(5))
    step(sched)
    sched.finish(a, "stop", "###")
    assert (a.status, a.finish_reason, a.stop_reason, a.block_table) == (SequenceStatus.FINISHED, "stop", "###", [])
    assert sched.running == []


@pytest.mark.parametrize("params, tokens, reason, stop_reason, outputs", [
    (dict(), [9, 2], "stop", None, [9, 2]),                                    # eos
    (dict(max_tokens=1), [2], "stop", None, [2]),                              # eos wins over length
    (dict(ignore_eos=True, max_tokens=3), [2, 2, 2], "length", None, [2, 2, 2]),
    (dict(stop_token_ids=[7]), [9, 7], "stop", 7, [9, 7]),
    (dict(max_tokens=3), [9, 9, 9], "length", None, [9, 9, 9]),
    (dict(max_tokens=None), [9, 9, 9], "length", None, [9, 9, 9]),            # max_model_len 8 = 5 + 3
    (dict(min_tokens=2), [2, 9, 2], "stop", None, [2, 9, 2]),                  # eos ignored until 2 others exist
    (dict(min_tokens=1, stop_token_ids=[7]), [7, 7], "stop", 7, [7, 7]),
])
def test_stop_conditions(new_sched, params, tokens, reason, stop_reason, outputs):
    sched = new_sched(max_model_len=8)
    a = add(sched, "a", range(10, 15), eos=(2,), **params)
    for i, token in enumerate(tokens):
        _, finished = step(sched, token)
        assert finished == ([a] if i == len(tokens) - 1 else [])
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == (reason, stop_reason, outputs)
    assert a.status == SequenceStatus.FINISHED and sched.running == []


def test_no_admission_in_a_step_that_preempted(new_sched):
    sched = new_sched(num_blocks=4, block_size=4, prefix_caching=False, max_num_batched_tokens=5)
    a = add(sched, "a", range(7), max_tokens=4)
    c = add(sched, "c", range(100, 108), max_tokens=2)
    plans = [plan(step(sched)[0]) for _ in range(3)]
    assert plans == [[("a", 5)], [("a", 2), ("c", 3)], [("a", 1), ("c", 4)]]
    assert (a.block_table, c.block_table) == ([0, 1], [2, 3])
    # a needs a third block: c is preempted and a takes block 3. Block 2 stays free and c's first chunk (4 tokens)
    # would fit, but admitting right after a preemption would only thrash.
    out, _ = step(sched)
    assert plan(out) == [("a", 1)] and out.preempted == [c] and a.block_table == [0, 1, 3]
    assert list(sched.waiting) == [c] and sched.block_manager.num_free_blocks == 1
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("c", 4)]  # next step c restarts from scratch
    assert c.block_table == [2] and c.num_computed_tokens == 4
    run_to_end(sched)
    assert c.output_token_ids == [TOKEN] * 2


def test_proposals_that_do_not_fit_are_dropped_not_preempting(new_sched):
    """Speculative proposals needing a block the pool lacks are dropped; no sequence is preempted for them."""
    sched = new_sched(num_blocks=2, block_size=4)
    a, b = add(sched, "a", [1, 2, 3]), add(sched, "b", [4, 5, 6])
    step(sched)                          # prefill: each fills 3 of its block's 4 slots and samples one token
    a.spec_token_ids = [7, 8]            # positions 3..5: a second block, none free
    out = sched.schedule()
    assert not out.preempted and plan(out) == [("a", 1), ("b", 1)]
    assert a.spec_token_ids == [] and out.scheduled[0].num_spec_tokens == 0
    sched.postprocess(out, [TOKEN, TOKEN])
    for seq in (a, b):
        sched.abort(seq.request_id)


def test_blocks_filled_by_a_finishing_verification_are_cached(new_sched):
    """A verification whose accepted proposals fill a block and whose last token ends the sequence leaves that block
    in the prefix cache, as plain decoding does for every computed full block."""
    sched = new_sched(block_size=4)
    a = add(sched, "a", [1, 2, 3], eos=(99,))
    step(sched)                                  # prefill; a = [1, 2, 3, 50], 3 computed
    a.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert plan(out) == [("a", 5)]
    sched.postprocess(out, [[5, 6, 7, 8, 99]])   # all accepted, the target's own token is EOS
    assert (a.finish_reason, a.output_token_ids) == ("stop", [50, 5, 6, 7, 8, 99])
    b = add(sched, "b", [1, 2, 3, 50, 5, 6, 7, 8, 9])
    assert len(sched.block_manager.get_computed_blocks(b)) == 2     # positions 0-7: both blocks
    sched.abort("b")
