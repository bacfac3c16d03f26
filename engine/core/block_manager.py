"""KV block ids of both tiers, ref counts, the prefix cache and the moves between tiers. Pure Python (no torch).

The GPU pool holds the blocks the kernels read. The optional CPU tier is a second pool of ids in host memory that
holds (a) the blocks of sequences preempted by swapping and (b) prefix-cache blocks evicted from the GPU pool, so
that a later hit copies the block back instead of recomputing it. Each tier evicts its least recently used free
cached block: the GPU pool into the CPU tier, the CPU tier for good.

Copies between tiers are queued as (gpu, cpu) swap-outs and (cpu, gpu) swap-ins and handed out with the step
(take_swaps). The runner performs them before the step's forward, swap-outs first, then swap-ins, then the
copy-on-write copies: so a GPU block whose content is being swapped out may be reused by the same step. A CPU
block read by a queued swap-in stays pinned until take_swaps, so it is never a swap-out target in the same step.
"""
from dataclasses import dataclass

from quant_serve.engine.core.block_pool import Block, BlockPool
from quant_serve.engine.core.sequence import Sequence, SequenceStatus

__all__ = ["Block", "BlockManager", "CpuHit", "hash_block"]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block. A module function so that tests can force collisions."""
    return hash((parent_hash, token_ids))


def root_hash(lora_id: int) -> int | None:
    """The parent hash of a sequence's first block: None for the base model, a key of its own per LoRA adapter, so
    that a chain (and the parent check of a hit) differs by adapter from the first block on."""
    return None if not lora_id else hash(("lora", lora_id))


@dataclass(frozen=True)
class CpuHit:
    """A prefix-cache hit held only by the CPU tier: allocate_slots copies it back into a GPU block."""
    cpu_block: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        # The GPU pool's state under the names the engine, the server and the tests read.
        self.blocks, self.free_queue, self.cached = self.gpu.blocks, self.gpu.free_queue, self.gpu.cached
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_in: list[tuple[int, int]] = []     # (cpu_block, gpu_block)
        self.pending_swap_out: list[tuple[int, int]] = []    # (gpu_block, cpu_block)
        self._pinned_cpu: list[int] = []                     # swap-in sources, released by take_swaps
        self.prefix_queries = 0              # tokens looked up
        self.prefix_hits = 0                 # tokens served from the cache (either tier)
        self.cpu_prefix_hits = 0             # blocks served from the CPU tier by prefix hits

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free if self.cpu else 0

    @property
    def usage(self) -> float:
        return 1.0 - self.gpu.num_free / self.num_blocks if self.num_blocks else 0.0

    # ---- the prefix cache and the GPU pool ---------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> list[int | CpuHit]:
        """The longest cached prefix of full blocks: GPU block ids, or CpuHit where only the CPU tier holds one."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        hit: list[int | CpuHit] = []
        parent = root_hash(seq.lora_id)
        # The last token is always computed so that the step has logits to sample from.
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash_block(parent, tokens)
            block_id = self.gpu.lookup(h, tokens, parent)
            if block_id is not None:
                hit.append(block_id)
            elif self.cpu is not None and (cpu_id := self.cpu.lookup(h, tokens, parent)) is not None:
                hit.append(CpuHit(cpu_id))
            else:
                break
            parent = h
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hit) * bs
        return hit

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int | CpuHit] | tuple = ()) -> bool:
        """Blocks for the next num_new_tokens (after the computed prefix, if given). False: nothing changed."""
        bs = self.block_size
        table = seq.block_table
        assert not computed_blocks or (not table and seq.num_computed_tokens == 0)
        start = seq.num_computed_tokens + len(computed_blocks) * bs
        end = start + num_new_tokens
        num_new_blocks = max(0, -(-end // bs) - len(table) - len(computed_blocks))
        # Existing blocks that this step writes into and that another sequence still reads: copy on write.
        cow = [j for j in range(start // bs, len(table)) if self.blocks[table[j]].ref_cnt > 1] if num_new_tokens else []
        gpu_hits = [b for b in computed_blocks if not isinstance(b, CpuHit)]
        num_from_cpu = len(computed_blocks) - len(gpu_hits)
        num_touched_free = sum(1 for b in gpu_hits if self.blocks[b].ref_cnt == 0)
        if num_new_blocks + len(cow) + num_touched_free + num_from_cpu > self.gpu.num_free:
            return False

        # Hold every hit before popping: a pop may evict a free cached block of either tier.
        for b in computed_blocks:
            if isinstance(b, CpuHit):
                self.cpu.touch(b.cpu_block)
                self._pinned_cpu.append(b.cpu_block)
            else:
                self.gpu.touch(b)
        for b in computed_blocks:
            table.append(self._copy_from_cpu(b.cpu_block) if isinstance(b, CpuHit) else b)
        self.cpu_prefix_hits += num_from_cpu
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
        parent = self.blocks[table[i - 1]].hash if i > 0 else root_hash(seq.lora_id)
        for j in range(i, num_full):
            tokens = tuple(seq.token_ids[j * bs:(j + 1) * bs])
            h = hash_block(parent, tokens)
            self.gpu.set_hash(table[j], h, tokens, parent)
            parent = h

    def trim(self, seq: Sequence) -> None:
        """Releases the blocks past the sequence's computed tokens (slots of rejected speculative tokens). They were
        allocated by this step and never hashed (only full computed blocks are)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.blocks[block_id].hash is None, f"block {block_id} past the computed tokens is hashed"
            self.gpu.release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        pool = self.cpu if seq.status == SequenceStatus.SWAPPED else self.gpu
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they are evicted first.
        for block_id in reversed(seq.block_table):
            pool.release(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.block_table:
            self.blocks[block_id].ref_cnt += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- the CPU tier ------------------------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> bool:
        """Moves a preempted sequence's blocks to the CPU tier; its block table then holds CPU ids. Blocks the
        tier already caches are shared, not copied. False (nothing changed) when the tier lacks room."""
        if self.cpu is None:
            return False
        held = [self._cpu_copy_of(g) for g in seq.block_table]
        num_touched_free = sum(1 for c in held if c is not None and self.cpu.blocks[c].ref_cnt == 0)
        if held.count(None) + num_touched_free > self.cpu.num_free:
            return False
        for c in held:
            if c is not None:
                self.cpu.touch(c)
        cpu_table = []
        for g, c in zip(seq.block_table, held):
            if c is None:
                c = self.cpu.pop_free()
                block = self.blocks[g]
                if block.hash is not None:
                    self.cpu.set_hash(c, block.hash, block.token_ids, block.parent_hash)
                self.pending_swap_out.append((g, c))
            cpu_table.append(c)
        for g in reversed(seq.block_table):
            self.gpu.release(g)
        seq.block_table = cpu_table
        return True

    def swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Brings a swapped sequence's blocks back (reusing GPU copies of cached blocks) and allocates slots for
        its next num_new_tokens. False (nothing changed) when the GPU pool lacks room."""
        cpu_table = seq.block_table
        held = [self._gpu_copy_of(c) for c in cpu_table]
        end = seq.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, -(-end // self.block_size) - len(cpu_table))
        num_touched_free = sum(1 for g in held if g is not None and self.blocks[g].ref_cnt == 0)
        if held.count(None) + num_touched_free + num_new_blocks > self.gpu.num_free:
            return False
        for g in held:
            if g is not None:
                self.gpu.touch(g)
        self._pinned_cpu.extend(cpu_table)   # the sequence's CPU refs end once the copies are handed out
        seq.block_table = [self._copy_from_cpu(c) if g is None else g for c, g in zip(cpu_table, held)]
        # Only full cached blocks were shared, and writes start after them: no copy on write, so this fits.
        assert self.allocate_slots(seq, num_new_tokens)
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """-> (swap_in [(cpu, gpu)], swap_out [(gpu, cpu)]) queued since the last call."""
        swap_in, swap_out = self.pending_swap_in, self.pending_swap_out
        self.pending_swap_in, self.pending_swap_out = [], []
        for c in self._pinned_cpu:
            self.cpu.release(c)
        self._pinned_cpu = []
        return swap_in, swap_out

    def _cpu_copy_of(self, gpu_block: int) -> int | None:
        block = self.blocks[gpu_block]
        return None if block.hash is None else self.cpu.lookup(block.hash, block.token_ids, block.parent_hash)

    def _gpu_copy_of(self, cpu_block: int) -> int | None:
        block = self.cpu.blocks[cpu_block]
        return None if block.hash is None else self.gpu.lookup(block.hash, block.token_ids, block.parent_hash)

    def _copy_from_cpu(self, cpu_block: int) -> int:
        gpu_block = self._pop_free()
        block = self.cpu.blocks[cpu_block]
        if block.hash is not None:
            self.gpu.set_hash(gpu_block, block.hash, block.token_ids, block.parent_hash)
        self.pending_swap_in.append((cpu_block, gpu_block))
        return gpu_block

    def _pop_free(self) -> int:
        victim = self.gpu.peek_free()
        if self.cpu is not None and self.gpu.is_cached(victim):
            self._save_to_cpu(victim)
        return self.gpu.pop_free()

    def _save_to_cpu(self, gpu_block: int) -> None:
        """An evicted GPU prefix block moves to the CPU tier (as a free cached block) instead of being dropped."""
        block = self.blocks[gpu_block]
        held = self.cpu.cached.get(block.hash)
        if held is not None:           # already there (or a colliding block is): keep that one
            self.cpu.refresh(held)
            return
        if not self.cpu.num_free:      # every CPU block belongs to a swapped sequence
            return
        c = self.cpu.pop_free()
        self.cpu.set_hash(c, block.hash, block.token_ids, block.parent_hash)
        self.cpu.release(c)
        self.pending_swap_out.append((gpu_block, c))
