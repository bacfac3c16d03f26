"""The CPU tier in the block manager and the scheduler: exact block ids of both tiers, swaps, LRU across tiers."""
import pytest

from quant_serve.engine.core.block_manager import BlockManager, CpuHit
from quant_serve.engine.config import SchedulerConfig
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.scheduler import Scheduler
from quant_serve.engine.core.sequence import Sequence, SequenceStatus

TOKEN = 50


def make_seq(tokens, rid="r", **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def compute(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def cpu_free(bm: BlockManager) -> list[int]:
    return list(bm.cpu.free_queue)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_cnt == 0 for b in bm.gpu.blocks)
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks and all(b.ref_cnt == 0 for b in bm.cpu.blocks)
    assert bm.take_swaps() == ([], []) and bm.pending_copies == []


@pytest.fixture
def new_bm():
    made = []

    def make(num_blocks, num_cpu_blocks, block_size=4) -> BlockManager:
        bm = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks)
        made.append(bm)
        return bm

    yield make
    for bm in made:
        assert_all_free(bm)


def swap_out(bm, seq) -> bool:
    """What the scheduler does on a swap preemption."""
    if not bm.swap_out(seq):
        return False
    seq.status = SequenceStatus.SWAPPED
    return True


def test_swap_out_then_in_copies_only_what_the_gpu_lost(new_bm):
    bm = new_bm(6, 4)
    a, b = make_seq(range(10), "a"), make_seq(range(100, 108), "b")
    assert bm.allocate_slots(a, 10) and bm.allocate_slots(b, 8)
    compute(bm, a)
    compute(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])

    assert swap_out(bm, a)
    assert a.block_table == [0, 1, 2]                        # CPU ids now
    assert bm.take_swaps() == ([], [(0, 0), (1, 1), (2, 2)])
    assert list(bm.free_queue) == [5, 2, 1, 0] and cpu_free(bm) == [3]
    assert sorted(bm.cpu.cached.values()) == [0, 1]          # a's two full blocks are cached in the CPU tier too
    assert [bm.cpu.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]

    # GPU blocks 0 and 1 still hold a's full blocks (lazy eviction): reused in place. Only the tail is copied.
    a.status = SequenceStatus.RUNNING
    assert bm.swap_in(a, 1)
    assert a.block_table == [0, 1, 5]
    assert bm.take_swaps() == ([(2, 5)], [])
    assert cpu_free(bm) == [3, 0, 1, 2]                      # released once the copies were handed out
    assert bm.cpu.lookup(bm.blocks[0].hash, bm.blocks[0].token_ids, None) == 0
    bm.free(a)
    bm.free(b)


def test_swap_in_fails_without_room_and_changes_nothing(new_bm):
    bm = new_bm(4, 4)
    a, b = make_seq(range(10), "a"), make_seq(range(100, 104), "b")
    assert bm.allocate_slots(a, 10) and bm.allocate_slots(b, 4)
    compute(bm, a)
    assert swap_out(bm, a)
    bm.take_swaps()
    c = make_seq(range(200, 212), "c")
    assert bm.allocate_slots(c, 12)                          # takes 2, 1, 0: a's cached GPU blocks are evicted
    assert c.block_table == [2, 1, 0]
    assert bm.take_swaps() == ([], [])                       # ... but the CPU tier already holds them
    before = (list(bm.free_queue), cpu_free(bm), list(a.block_table))
    a.num_computed_tokens, a.status = 10, SequenceStatus.SWAPPED
    assert not bm.swap_in(a, 1)                              # 3 blocks needed, none free
    assert (list(bm.free_queue), cpu_free(bm), list(a.block_table)) == before
    assert bm.take_swaps() == ([], [])
    bm.free(a)                                               # an aborted swapped sequence frees CPU blocks
    assert cpu_free(bm) == [3, 2, 1, 0]
    bm.free(b)
    bm.free(c)


def test_evicted_prefix_block_moves_to_cpu_and_is_hit_later(new_bm):
    bm = new_bm(4, 4)
    a = make_seq(range(9), "a")
    assert bm.allocate_slots(a, 9)
    compute(bm, a)
    bm.free(a)
    assert list(bm.free_queue) == [3, 2, 1, 0]
    h0, h1 = bm.blocks[0].hash, bm.blocks[1].hash

    b = make_seq(range(100, 116), "b")
    assert bm.allocate_slots(b, 16)
    assert b.block_table == [3, 2, 1, 0]
    assert bm.take_swaps() == ([], [(1, 0), (0, 1)])        # evicted in GPU LRU order, into CPU blocks 0 and 1
    assert bm.cpu.cached == {h1: 0, h0: 1} and bm.cached == {}
    assert cpu_free(bm) == [2, 3, 0, 1]                      # cached, free, most recent last
    bm.free(b)

    c = make_seq(list(range(8)) + [7], "c")
    hit = bm.get_computed_blocks(c)
    assert hit == [CpuHit(1), CpuHit(0)]
    assert (bm.prefix_queries, bm.prefix_hits) == (9, 8)
    assert bm.allocate_slots(c, 1, hit)
    assert c.block_table == [0, 1, 2]
    assert bm.take_swaps() == ([(1, 0), (0, 1)], [])
    assert bm.cpu_prefix_hits == 2
    assert (bm.blocks[0].hash, bm.blocks[1].hash) == (h0, h1) and bm.cached == {h0: 0, h1: 1}
    assert cpu_free(bm) == [2, 3, 1, 0]
    compute(bm, c)
    # Both tiers hold the prefix now; a GPU hit wins.
    assert bm.get_computed_blocks(make_seq(list(range(8)) + [9])) == [0, 1]
    bm.free(c)


def test_cpu_hit_is_pinned_while_the_same_step_evicts(new_bm):
    bm = new_bm(3, 1)
    a = make_seq(range(5), "a")
    assert bm.allocate_slots(a, 5)
    compute(bm, a)
    bm.free(a)
    b = make_seq(range(100, 112), "b")
    assert bm.allocate_slots(b, 12)                          # evicts a's block 0 into CPU block 0
    assert bm.take_swaps() == ([], [(0, 0)])
    compute(bm, b)
    bm.free(b)                                               # b's blocks 2, 1, 0 are cached on the GPU
    c = make_seq(list(range(4)) + [9], "c")
    hit = bm.get_computed_blocks(c)
    assert hit == [CpuHit(0)]
    # Popping GPU blocks evicts b's cached blocks; the only CPU block is being read by the swap-in, so they drop.
    assert bm.allocate_slots(c, 1, hit)
    assert c.block_table == [0, 1]
    assert bm.take_swaps() == ([(0, 0)], [])
    assert sorted(bm.cpu.cached.values()) == [0]
    bm.free(c)


def test_lru_across_tiers(new_bm):
    bm = new_bm(4, 2)
    a, b = make_seq(range(8), "a"), make_seq(range(100, 108), "b")
    assert bm.allocate_slots(a, 8)
    compute(bm, a)
    bm.free(a)                                               # GPU LRU: 2, 3, 1, 0
    assert bm.allocate_slots(b, 8) and b.block_table == [2, 3]
    compute(bm, b)
    bm.free(b)                                               # GPU LRU: 1, 0, 3, 2 (a older than b)
    c = make_seq(range(200, 216), "c")
    assert bm.allocate_slots(c, 16) and c.block_table == [1, 0, 3, 2]
    # Each eviction lands in the CPU tier, whose own LRU block makes room: a's blocks go first, b's stay.
    assert bm.take_swaps() == ([], [(1, 0), (0, 1), (3, 0), (2, 1)])
    assert bm.get_computed_blocks(make_seq(range(9))) == []
    assert bm.get_computed_blocks(make_seq(list(range(100, 108)) + [1])) == [CpuHit(1), CpuHit(0)]
    bm.free(c)


def test_cpu_tier_full_means_recompute_and_drops(new_bm):
    bm = new_bm(4, 2)
    a = make_seq(range(10), "a")
    assert bm.allocate_slots(a, 10)
    compute(bm, a)
    before = (list(bm.free_queue), cpu_free(bm), list(a.block_table))
    assert not swap_out(bm, a)                               # 3 blocks, 2 in the tier: the caller recomputes
    assert (list(bm.free_queue), cpu_free(bm), list(a.block_table)) == before
    assert bm.take_swaps() == ([], [])
    bm.free(a)

    x = make_seq(range(300, 308), "x")
    assert bm.allocate_slots(x, 8) and x.block_table == [3, 2]
    compute(bm, x)
    assert swap_out(bm, x) and x.block_table == [0, 1] and bm.num_free_cpu_blocks == 0
    assert bm.take_swaps() == ([], [(3, 0), (2, 1)])
    # GPU evictions: x's blocks are already in the tier (no copy); a's find no free CPU block and are dropped.
    y = make_seq(range(400, 416), "y")
    assert bm.allocate_slots(y, 16) and y.block_table == [1, 0, 2, 3]
    assert bm.take_swaps() == ([], [])
    assert list(bm.cpu.cached.values()) == [0, 1] and bm.cached == {}
    bm.free(x)
    bm.free(y)


# ---- the scheduler ----------------------------------------------------------------------------------------
@pytest.fixture
def new_sched():
    made = []

    def make(num_blocks, num_cpu_blocks, block_size=4, **cfg) -> Scheduler:
        cfg.setdefault("max_num_batched_tokens", 64)
        sched = Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, True, num_cpu_blocks))
        made.append(sched)
        return sched

    yield make
    for sched in made:
        assert not sched.has_unfinished()
        assert_all_free(sched.block_manager)


def add(sched, rid, prompt, **params) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(**params))
    sched.add_sequence(seq)
    return seq


def step(sched):
    out = sched.schedule()
    sched.postprocess(out, [TOKEN if s.sample else None for s in out.scheduled])
    return out


def plan(out) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def run_to_end(sched, max_steps=100) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("requests did not finish")


def test_preempted_sequence_is_swapped_and_resumes_where_it_stopped(new_sched):
    sched = new_sched(4, 4)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=2)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=3)
    c = add(sched, "c", [9, 10, 11, 12], max_tokens=3)
    step(sched)
    assert [s.block_table for s in (a, b, c)] == [[0], [1], [2]]

    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == [c]
    assert out.blocks_to_swap_out == [(2, 0)] and out.blocks_to_swap_in == []
    assert c.status == SequenceStatus.SWAPPED and list(sched.swapped) == [c] and c.block_table == [0]
    assert c.num_computed_tokens == 4 and b.block_table == [1, 2] and a.is_finished
    assert (sched.num_preemptions_total, sched.num_swap_preemptions_total) == (1, 1)

    # c continues with its one new token (recompute would run 5); a's freed head block is evicted to the tier.
    out = step(sched)
    assert plan(out) == [("b", 1), ("c", 1)]
    assert out.blocks_to_swap_in == [(0, 3)] and out.blocks_to_swap_out == [(0, 1)]
    assert c.block_table == [3, 0] and c.num_computed_tokens == 5 and c.status == SequenceStatus.RUNNING
    assert list(sched.block_manager.cpu.free_queue) == [2, 3, 1, 0]
    run_to_end(sched)
    assert c.output_token_ids == [TOKEN] * 3 and b.output_token_ids == [TOKEN] * 3


def test_cpu_tier_full_falls_back_to_recompute(new_sched):
    sched = new_sched(4, 1)
    seqs = [add(sched, rid, range(i * 10, i * 10 + 4), max_tokens=3) for i, rid in enumerate("abcd")]
    a, b, c, d = seqs
    step(sched)
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == [d, c]
    assert d.status == SequenceStatus.SWAPPED and c.status == SequenceStatus.WAITING
    assert out.blocks_to_swap_out == [(3, 0)] and (a.block_table, b.block_table) == ([0, 3], [1, 2])
    assert (sched.num_preemptions_total, sched.num_swap_preemptions_total) == (2, 1)

    out = step(sched)                                       # a, b finish; nothing fits d yet, c waits behind it
    assert plan(out) == [("a", 1), ("b", 1)] and a.is_finished and b.is_finished

    out = step(sched)
    assert plan(out) == [("d", 1), ("c", 5)]                 # d swapped in first, c recomputed from scratch
    assert out.blocks_to_swap_in == [(0, 3)] and out.blocks_to_swap_out == []
    assert (d.block_table, c.block_table) == ([3, 0], [2, 1])
    run_to_end(sched)
    assert all(s.output_token_ids == [TOKEN] * 3 for s in seqs)


def test_abort_swapped_sequence(new_sched):
    sched = new_sched(2, 4)
    a = add(sched, "a", [1, 2, 3], max_tokens=2)
    b = add(sched, "b", [4, 5, 6, 7], max_tokens=3)
    step(sched)
    out = step(sched)
    assert out.preempted == [b] and b.status == SequenceStatus.SWAPPED
    assert sched.abort("b") is b and b.finish_reason == "abort" and list(sched.swapped) == []
    assert sched.block_manager.num_free_cpu_blocks == 4
    run_to_end(sched)
    assert a.output_token_ids == [TOKEN] * 2
