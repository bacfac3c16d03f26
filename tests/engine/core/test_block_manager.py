"""BlockManager: exact block ids, ref counts, LRU free queue, prefix cache and copy-on-write."""
import subprocess
import sys
from pathlib import Path

import pytest

from quant_serve.engine.core import block_manager as bm_module
from quant_serve.engine.core.block_manager import BlockManager, hash_block
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import Sequence

REPO = Path(__file__).resolve().parents[3]


def make_seq(tokens, rid="r", **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    assert bm.usage == 0.0
    assert bm.pending_copies == []


@pytest.fixture
def new_bm():
    made = []

    def make(num_blocks=8, block_size=4, **kw) -> BlockManager:
        bm = BlockManager(num_blocks, block_size, **kw)
        made.append(bm)
        return bm

    yield make
    for bm in made:
        assert_all_free(bm)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a step does to a sequence: its KV is now written up to num_tokens (default: all)."""
    seq.num_computed_tokens = seq.num_tokens if num_tokens is None else num_tokens
    bm.cache_full_blocks(seq)


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


def test_allocate_in_order(new_bm):
    bm = new_bm(8)
    a, b = make_seq(range(10), "a"), make_seq(range(5), "b")
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(5 / 8)
    assert [bm.blocks[i].ref_cnt for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and b.block_table == []


def test_append_across_block_boundary(new_bm):
    bm = new_bm(8)
    seq = make_seq([1, 2, 3])
    assert bm.allocate_slots(seq, 3)
    assert seq.block_table == [0]
    compute(bm, seq)
    seq.append_token(4)                      # position 3: last slot of block 0
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0]
    compute(bm, seq)
    seq.append_token(5)                      # position 4: needs block 1
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0, 1]
    assert bm.num_free_blocks == 6
    bm.free(seq)


def test_free_reverse_order_and_lru_reuse(new_bm):
    bm = new_bm(6)
    a = make_seq(range(100, 112), "a")       # 3 full blocks
    b = make_seq(range(200, 204), "b")
    assert bm.allocate_slots(a, 12) and bm.allocate_slots(b, 4)
    compute(bm, a)
    compute(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3])
    bm.free(a)
    assert free_order(bm) == [4, 5, 2, 1, 0]  # never-used blocks first, then a's tail before its head
    bm.free(b)
    assert free_order(bm) == [4, 5, 2, 1, 0, 3]
    # A new sequence takes from the head: block 2 (a's tail) is reused and its hash evicted.
    c = make_seq(range(300, 312), "c")
    assert bm.allocate_slots(c, 12)
    assert c.block_table == [4, 5, 2]
    assert sorted(bm.cached.values()) == [0, 1, 3]
    # a's first two blocks are still hittable (lazy eviction), the third is gone.
    assert bm.get_computed_blocks(make_seq(list(range(100, 112)) + [7])) == [0, 1]
    again = make_seq(list(range(100, 108)) + [7], "again")
    hit = bm.get_computed_blocks(again)
    assert hit == [0, 1]
    assert bm.allocate_slots(again, 1, hit)
    assert again.block_table == [0, 1, 3]    # touching 1 and 0 takes them out of the queue; 3 is the head
    assert free_order(bm) == []
    bm.free(c)
    bm.free(again)
    assert free_order(bm) == [2, 5, 4, 3, 1, 0]


def test_fork_and_copy_on_write(new_bm):
    bm = new_bm(8)
    parent = make_seq([1, 2, 3, 4, 5, 6], "p")
    assert bm.allocate_slots(parent, 6)
    compute(bm, parent)
    parent.append_token(7)
    child = make_seq([1, 2, 3, 4, 5, 6], "c")
    child.token_ids = list(parent.token_ids)
    bm.fork(parent, child)
    assert child.block_table == [0, 1] and child.num_computed_tokens == 6
    assert (bm.blocks[0].ref_cnt, bm.blocks[1].ref_cnt) == (2, 2)

    # The parent writes position 6 into shared, half-full block 1: it gets a private copy.
    assert bm.allocate_slots(parent, 1)
    assert parent.block_table == [0, 2]
    assert bm.take_copies() == [(1, 2)]
    assert bm.take_copies() == []
    assert [bm.blocks[i].ref_cnt for i in range(3)] == [2, 1, 1]
    # The child is now block 1's only reader and writes in place.
    child.token_ids[-1] = 8
    assert bm.allocate_slots(child, 1)
    assert child.block_table == [0, 1]
    assert bm.take_copies() == []
    bm.free(parent)
    bm.free(child)


def test_fork_at_block_boundary_needs_no_copy(new_bm):
    bm = new_bm(8)
    parent = make_seq(range(8), "p")
    assert bm.allocate_slots(parent, 8)
    compute(bm, parent)
    parent.append_token(9)
    child = make_seq(range(8), "c")
    child.token_ids = list(parent.token_ids)
    bm.fork(parent, child)
    assert bm.allocate_slots(parent, 1) and bm.allocate_slots(child, 1)
    assert (parent.block_table, child.block_table) == ([0, 1, 2], [0, 1, 3])
    assert bm.take_copies() == []
    bm.free(child)
    assert (bm.blocks[0].ref_cnt, bm.blocks[3].ref_cnt) == (1, 0)
    bm.free(parent)


def test_eviction_when_free_list_runs_out(new_bm):
    bm = new_bm(5)
    a = make_seq(range(100, 109), "a")       # blocks 0, 1 full and hashed, block 2 partial
    assert bm.allocate_slots(a, 9)
    compute(bm, a)
    bm.free(a)
    assert free_order(bm) == [3, 4, 2, 1, 0]
    assert bm.cached == {bm.blocks[0].hash: 0, bm.blocks[1].hash: 1}
    b = make_seq(range(200, 212), "b")
    assert bm.allocate_slots(b, 12)
    assert b.block_table == [3, 4, 2]        # block 2 had no hash: nothing evicted yet
    assert bm.get_computed_blocks(make_seq(range(100, 109))) == [0, 1]
    c = make_seq(range(300, 304), "c")
    assert bm.allocate_slots(c, 4)
    assert c.block_table == [1]              # the LRU cached block is evicted...
    assert bm.blocks[1].hash is None and list(bm.cached.values()) == [0]
    assert bm.get_computed_blocks(make_seq(range(100, 109))) == [0]   # ...and a's head survives
    bm.free(b)
    bm.free(c)


def test_prefix_hit_on_shared_system_prompt(new_bm):
    bm = new_bm(10)
    system = list(range(1000, 1008))         # two full blocks
    a = make_seq(system + [1, 2, 3], "a")
    assert bm.get_computed_blocks(a) == []
    assert (bm.prefix_queries, bm.prefix_hits) == (11, 0)
    assert bm.allocate_slots(a, 11)
    compute(bm, a)
    assert a.block_table == [0, 1, 2]

    b = make_seq(system + [7, 8], "b")
    hit = bm.get_computed_blocks(b)
    assert hit == [0, 1]
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)
    assert bm.allocate_slots(b, 2, hit)
    assert b.block_table == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # The hashes are the documented chain.
    h0 = hash_block(None, tuple(system[:4]))
    assert bm.blocks[0].hash == h0 and bm.blocks[1].hash == hash_block(h0, tuple(system[4:]))
    bm.free(a)
    bm.free(b)


def test_full_prompt_hit_keeps_last_token_uncomputed(new_bm):
    bm = new_bm(8)
    a = make_seq(range(8), "a")
    assert bm.allocate_slots(a, 8)
    compute(bm, a)
    bm.free(a)
    same = make_seq(range(8), "same")
    hit = bm.get_computed_blocks(same)
    assert hit == [0]                        # block 1 would cover the last token: recomputed instead
    assert bm.prefix_hits == 4
    assert bm.allocate_slots(same, 4, hit)
    assert same.block_table == [0, 2]
    longer = make_seq(list(range(8)) + [9], "longer")
    assert bm.get_computed_blocks(longer) == [0, 1]
    bm.free(same)


def test_hash_collision_is_not_a_hit(new_bm, monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 7)
    bm = new_bm(8)
    a = make_seq([1, 2, 3, 4, 5], "a")
    assert bm.allocate_slots(a, 5)
    compute(bm, a)
    assert bm.cached == {7: 0}
    assert bm.get_computed_blocks(make_seq([9, 9, 9, 9, 5])) == []
    # A colliding block computed later does not take over the entry.
    b = make_seq([9, 9, 9, 9, 5], "b")
    assert bm.allocate_slots(b, 5)
    compute(bm, b)
    assert b.block_table == [2, 3] and bm.cached == {7: 0}
    assert bm.get_computed_blocks(make_seq([9, 9, 9, 9, 5])) == []
    bm.free(b)
    # Same tokens at the root hit; the next block collides with block 0 but holds other tokens.
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])) == [0]
    bm.free(a)


def test_hit_requires_same_parent(new_bm, monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: hash(tokens))  # ignores the prefix
    bm = new_bm(8)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert bm.allocate_slots(a, 9)
    compute(bm, a)
    # [5, 6, 7, 8] is cached (block 1) but after [1, 2, 3, 4], not at the start of a sequence.
    assert bm.get_computed_blocks(make_seq([5, 6, 7, 8, 9])) == []
    bm.free(a)


def test_no_hits_when_caching_disabled_or_prompt_logprobs(new_bm):
    off = new_bm(8, enable_prefix_caching=False)
    a = make_seq(range(9), "a")
    assert off.allocate_slots(a, 9)
    compute(off, a)
    assert off.cached == {} and all(b.hash is None for b in off.blocks)
    assert off.get_computed_blocks(make_seq(range(9))) == []
    assert (off.prefix_queries, off.prefix_hits) == (0, 0)
    off.free(a)

    on = new_bm(8)
    b = make_seq(range(9), "b")
    assert on.allocate_slots(b, 9)
    compute(on, b)
    assert on.get_computed_blocks(make_seq(range(9), prompt_logprobs=1)) == []
    assert on.get_computed_blocks(make_seq(range(9))) == [0, 1]
    on.free(b)


def snapshot(bm: BlockManager):
    return (free_order(bm), dict(bm.cached), [(b.ref_cnt, b.hash) for b in bm.blocks], list(bm.pending_copies))


def test_allocate_failure_changes_nothing(new_bm):
    bm = new_bm(4)
    a = make_seq(range(8), "a")
    assert bm.allocate_slots(a, 8)
    compute(bm, a)
    before = snapshot(bm)
    b = make_seq(range(100, 112), "b")
    assert not bm.allocate_slots(b, 12)      # 3 blocks needed, 2 free
    assert b.block_table == [] and snapshot(bm) == before

    bm.free(a)
    # 2 cached free blocks to touch + 3 new = 5 > 4: the touched blocks must stay free and cached.
    c = make_seq(list(range(8)) + list(range(50, 59)), "c")
    hit = bm.get_computed_blocks(c)
    assert hit == [0, 1]
    before = snapshot(bm)
    assert not bm.allocate_slots(c, 9, hit)
    assert c.block_table == [] and snapshot(bm) == before
    # With one block less to compute it fits exactly.
    c.token_ids = c.token_ids[:-1]
    assert bm.allocate_slots(c, 8, hit)
    assert c.block_table == [0, 1, 2, 3] and bm.num_free_blocks == 0
    bm.free(c)


def test_copy_on_write_failure_changes_nothing(new_bm):
    bm = new_bm(2)
    parent = make_seq([1, 2, 3, 4, 5, 6], "p")
    assert bm.allocate_slots(parent, 6)
    compute(bm, parent)
    parent.append_token(7)
    child = make_seq([1, 2, 3, 4, 5, 6], "c")
    bm.fork(parent, child)
    before = snapshot(bm)
    assert not bm.allocate_slots(parent, 1)  # needs a copy of block 1, no block free
    assert parent.block_table == [0, 1] and snapshot(bm) == before
    bm.free(child)
    assert bm.allocate_slots(parent, 1)      # sole owner now: writes in place
    assert parent.block_table == [0, 1] and bm.take_copies() == []
    bm.free(parent)


def test_pure_python_modules_never_import_torch():
    code = ("import quant_serve.engine.core.scheduler, quant_serve.engine.core.block_manager, quant_serve.engine.core.sequence, sys; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
