"""Prefix-affinity routing, pure Python (the Ray router in cluster_router.py is a thin shell around it).

A prompt's routing key is the chained hash of its first KV blocks, computed with the prefix cache's own hash_block
over the same block boundaries, so two prompts get the same key exactly when the prefix cache could share those
blocks. Keys are placed on a consistent-hash ring of replicas (virtual nodes), with bounded loads (Mirrokni, Thorup
and Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2016): a replica takes a key only while its load stays
under ceil(load_factor * mean load); otherwise the key walks the ring to the next replica. Adding or removing a
replica moves only the keys whose ring walk meets that replica first.
"""
import bisect
import hashlib
import math
from dataclasses import dataclass, field

from quant_serve.engine.core.block_manager import hash_block

# The prefix cache's chain starts from parent None. hash(None) differs between processes before Python 3.12, and
# several routers (one per ingress replica, per machine) must agree on a key, so the chain starts from 0 here.
ROOT_PARENT = 0


def prefix_key(token_ids: list[int], block_size: int, max_blocks: int) -> int | None:
    """The chained hash of the prompt's first min(max_blocks, full blocks) KV blocks; a prompt shorter than one
    block is hashed as it is (it shares no block with anything, but still routes the same way every time). None for
    an empty prompt."""
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
    if not token_ids:
        return None
    num_full = min(len(token_ids) // block_size, max_blocks)
    if num_full == 0:
        return hash_block(ROOT_PARENT, tuple(token_ids))
    parent = ROOT_PARENT
    for i in range(num_full):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
    return parent


def _point(data: bytes) -> int:
    """A 64-bit ring position, the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def key_point(key: int) -> int:
    return _point((key & (2**64 - 1)).to_bytes(8, "little"))


@dataclass
class HashRing:
    """Replicas (any string ids) on a ring, each at vnodes positions."""
    vnodes: int = 64
    load_factor: float = 1.25          # c: a replica may hold up to ceil(c * mean load) requests
    _points: list[int] = field(default_factory=list)
    _owners: list[str] = field(default_factory=list)
    _members: set[str] = field(default_factory=set)

    def __post_init__(self):
        if self.vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {self.vnodes}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1 (a bound under the mean load cannot be met), got "
                             f"{self.load_factor}")

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def set_members(self, replicas) -> None:
        """Rebuild for this set of replicas; each replica's positions depend on its id only, so a replica that
        comes or goes moves only its own keys."""
        replicas = set(replicas)
        if replicas == self._members:
            return
        ring = sorted((_point(f"{r}#{i}".encode()), r) for r in replicas for i in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [r for _, r in ring]
        self._members = replicas

    def walk(self, key: int) -> list[str]:
        """The distinct replicas in ring order from the key's position (the first one owns the key)."""
        if not self._points:
            return []
        start = bisect.bisect_left(self._points, key_point(key))
        order, seen = [], set()
        for j in range(len(self._points)):
            owner = self._owners[(start + j) % len(self._points)]
            if owner not in seen:
                seen.add(owner)
                order.append(owner)
                if len(order) == len(self._members):
                    break
        return order

    def capacity(self, loads: dict[str, int]) -> int:
        """The most requests a replica may hold once this one is placed."""
        total = sum(loads.get(r, 0) for r in self._members) + 1
        return math.ceil(self.load_factor * total / len(self._members))

    def rank(self, key: int | None, loads: dict[str, int]) -> list[str]:
        """Every replica, best first: the first one on the key's ring walk that is under its bound, then the rest by
        load (ties in ring order). A request without a key (nothing to share) goes to the least loaded."""
        if not self._members:
            return []
        order = self.walk(key) if key is not None else sorted(self._members)
        by_load = sorted(order, key=lambda r: loads.get(r, 0))     # stable: ties keep ring order
        if key is None:
            return by_load
        cap = self.capacity(loads)
        chosen = next((r for r in order if loads.get(r, 0) < cap), by_load[0])
        return [chosen] + [r for r in by_load if r != chosen]
