"""One tier of KV block ids (the GPU pool or the CPU tier): ref counts, the LRU free queue and the hash index of
full, computed blocks. Pure Python (no torch); hashing and the policy between tiers live in block_manager.py."""
from collections import OrderedDict
from dataclasses import dataclass


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


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order: allocation pops the head, freed blocks join the tail. Holds exactly the ref_cnt == 0 blocks.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}     # hash -> block_id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> int | None:
        """The cached block holding exactly these tokens after this parent, or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids or block.parent_hash != parent_hash:
            return None
        return block_id

    def set_hash(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.parent_hash = block_hash, token_ids, parent_hash
        # On a collision (or the same content held twice) the first block keeps the entry.
        self.cached.setdefault(block_hash, block_id)

    def is_cached(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.hash is not None and self.cached.get(block.hash) == block_id

    def touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        assert block.ref_cnt >= 0, f"block {block_id} freed twice"
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None

    def peek_free(self) -> int:
        return next(iter(self.free_queue))

    def pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        # Lazy eviction: a freed block stays hittable until this moment.
        if self.is_cached(block_id):
            del self.cached[self.blocks[block_id].hash]
        self.blocks[block_id].reset()
        self.blocks[block_id].ref_cnt = 1
        return block_id

    def refresh(self, block_id: int) -> None:
        """Mark a free block as recently used (tail of the LRU queue)."""
        if self.blocks[block_id].ref_cnt == 0:
            self.free_queue.move_to_end(block_id)
