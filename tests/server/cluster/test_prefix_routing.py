"""Prefix keys and the bounded-load consistent-hash ring (server/cluster/prefix_routing.py): pure Python, no Ray."""
import random

import pytest

from quant_serve.engine.core.block_manager import hash_block
from quant_serve.server.cluster.prefix_routing import ROOT_PARENT, HashRing, prefix_key

BS = 16


def test_prefix_key_is_the_prefix_cache_chain_of_the_first_blocks():
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(5 * BS + 3)]
    expected = ROOT_PARENT
    for i in range(2):
        expected = hash_block(expected, tuple(prompt[i * BS:(i + 1) * BS]))
    assert prefix_key(prompt, BS, max_blocks=2) == expected
    # only the first max_blocks blocks count: anything after them leaves the key alone
    other_tail = prompt[:2 * BS] + [7] * 40
    assert prefix_key(other_tail, BS, 2) == expected
    # one token changed inside the first blocks: another key
    changed = list(prompt)
    changed[2 * BS - 1] += 1
    assert prefix_key(changed, BS, 2) != expected
    # fewer full blocks than max_blocks: the full ones; shorter than a block: the tokens themselves
    assert prefix_key(prompt[:BS + 5], BS, 4) == hash_block(ROOT_PARENT, tuple(prompt[:BS]))
    assert prefix_key(prompt[:5], BS, 4) == hash_block(ROOT_PARENT, tuple(prompt[:5]))
    assert prefix_key([], BS, 4) is None
    with pytest.raises(ValueError, match="max_blocks"):
        prefix_key(prompt, BS, 0)


def _owners(ring: HashRing, keys: list[int]) -> dict[int, str]:
    return {k: ring.rank(k, {})[0] for k in keys}


def test_removing_or_adding_a_replica_moves_only_its_keys():
    rng = random.Random(1)
    keys = [prefix_key([rng.randrange(50000) for _ in range(BS)], BS, 1) for _ in range(3000)]
    ring = HashRing(vnodes=64)
    ring.set_members(["a", "b", "c", "d"])
    before = _owners(ring, keys)
    counts = {r: sum(o == r for o in before.values()) for r in "abcd"}
    assert all(450 < n < 1050 for n in counts.values()), counts      # 750 each on average
    ring.set_members(["a", "b", "d"])
    after = _owners(ring, keys)
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "c"}            # exactly c's keys move, nothing else
    ring.set_members(["a", "b", "c", "d", "e"])
    grown = _owners(ring, keys)
    moved = {k for k in keys if before[k] != grown[k]}
    assert moved and all(grown[k] == "e" for k in moved)             # only keys that now belong to e move


def test_same_prefix_same_replica_and_the_walk_is_deterministic():
    ring = HashRing(vnodes=16)
    ring.set_members(["r1", "r2", "r3"])
    system = list(range(100, 100 + 4 * BS))
    keys = {prefix_key(system + [u, u + 1, u + 2], BS, 4) for u in range(50)}
    assert len(keys) == 1                                              # users share the system prompt's blocks
    key = keys.pop()
    assert len({ring.rank(key, {})[0] for _ in range(5)}) == 1
    other = HashRing(vnodes=16)
    other.set_members(["r3", "r1", "r2"])                              # another router, another order: same ring
    assert other.walk(key) == ring.walk(key)
    assert sorted(ring.walk(key)) == ["r1", "r2", "r3"]


def test_bounded_load_a_hot_prefix_spills_in_ring_order_and_never_exceeds_the_bound():
    ring = HashRing(vnodes=32, load_factor=1.25)
    ring.set_members(["a", "b", "c", "d"])
    hot = prefix_key(list(range(64)), BS, 4)
    walk = ring.walk(hot)
    loads = {r: 0 for r in walk}
    for _ in range(200):                       # 200 requests of one hot prefix arrive, none finishes
        cap = ring.capacity(loads)
        chosen = ring.rank(hot, loads)[0]
        assert loads[chosen] < cap
        # the chosen one is the first replica of the walk that still had room
        assert chosen == next(r for r in walk if loads[r] < cap)
        loads[chosen] += 1
        assert max(loads.values()) <= cap
    # the owner fills to ceil(1.25 x 200 / 4) = 63, then the next on the walk, ...: the hot prefix sits on as few
    # replicas as the bound allows
    assert [loads[r] for r in walk] == [63, 63, 62, 12]
    # with room, the owner takes the key; the fallbacks follow by load
    loads = {"a": 3, "b": 0, "c": 1, "d": 2}
    ranked = ring.rank(hot, loads)
    assert ranked[0] == walk[0] and sorted(ranked) == ["a", "b", "c", "d"]
    rest = ranked[1:]
    assert [loads[r] for r in rest] == sorted(loads[r] for r in rest)
    # no key: least loaded first
    assert ring.rank(None, loads)[0] == "b"


def test_bad_ring_options_are_refused():
    with pytest.raises(ValueError, match="load_factor"):
        HashRing(load_factor=0.9)
    with pytest.raises(ValueError, match="vnodes"):
        HashRing(vnodes=0)
    assert HashRing().rank(123, {}) == []
