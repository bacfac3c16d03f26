"""KV block ids, ref counts, the LRU free queue and the prefix cache. Pure Python (no torch)."""
from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block. A module function so that tests can force collisions."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: int | None = None                  # set once the block is full and computed
    token_ids: tuple[int, ...] = ()          # kept to verify a cache hit (hashes can collide)
    parent_hash: int | None = None

    def reset(self) -> None:
        self.hash = None
        self.token_ids = ()
        self.parent_hash = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order: allocation pops the head, freed blocks join the tail. Holds exactly the ref_cnt == 0 blocks.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}     # hash -> block_id
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0              # tokens looked up
        self.prefix_hits = 0                 # tokens served from the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks if self.num_blocks else 0.0

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        hit: list[int] = []
        parent = None
        # The last token is always computed so that the step has logits to sample from.
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:
                break
            hit.append(block_id)
            parent = h
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hit) * bs
        return hit

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | tuple = ()) -> bool:
        bs = self.block_size
        table = seq.block_table
        assert not computed_blocks or (not table and seq.num_computed_tokens == 0)
        start = seq.num_computed_tokens + len(computed_blocks) * bs
        end = start + num_new_tokens
        num_new_blocks = max(0, -(-end // bs) - len(table) - len(computed_blocks))
        # Existing blocks that this step writes into and that another sequence still reads: copy on write.
        cow = [j for j in range(start // bs, len(table)) if self.blocks[table[j]].ref_cnt > 1] if num_new_tokens else []
        num_touched_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks + len(cow) + num_touched_free > len(self.free_queue):
            return False

        for block_id in computed_blocks:
            self._touch(block_id)
        if computed_blocks:
            table.extend(computed_blocks)
        for j in cow:
            src = table[j]
            dst = self._pop_free()
            self.blocks[src].ref_cnt -= 1    # still > 0: the other reader keeps it
            table[j] = dst
            self.pending_copies.append((src, dst))
        for _ in range(num_new_blocks):
            table.append(self._pop_free())
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = seq.block_table
        num_full = min(seq.num_computed_tokens // bs, len(table))
        # Hashed blocks form a prefix of the table; walk back to its end instead of rehashing from the start.
        i = num_full
        while i > 0 and self.blocks[table[i - 1]].hash is None:
            i -= 1
        parent = self.blocks[table[i - 1]].hash if i > 0 else None
        for j in range(i, num_full):
            block = self.blocks[table[j]]
            tokens = tuple(seq.token_ids[j * bs:(j + 1) * bs])
            h = hash_block(parent, tokens)
            block.hash, block.token_ids, block.parent_hash = h, tokens, parent
            # On a collision (or the same content computed twice) the first block keeps the entry.
            self.cached.setdefault(h, block.block_id)
            parent = h

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they are evicted first.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self.blocks[block_id].ref_cnt += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        # Lazy eviction: a freed block stays hittable until this moment.
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.reset()
        block.ref_cnt = 1
        return block_id
