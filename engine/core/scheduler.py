"""Decides each step: which sequences run and how many tokens each computes. Pure Python (no torch)."""
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quant_serve.engine.core.block_manager import BlockManager
from quant_serve.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:  # engine.config imports torch; the scheduler must not
    from quant_serve.engine.config import SchedulerConfig


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int    # compute token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]
    # True when this step computes the sequence's last known token, so a next token is sampled. Fixed when the
    # entry is made, because postprocess later moves num_computed_tokens and num_tokens.
    sample: bool = field(init=False)
    advanced: bool = field(init=False, default=False)   # Scheduler.advance() applied it (the sequence was running)
    # speculative decoding: the last num_spec_tokens of the new tokens are the sequence's proposals (spec_token_ids)
    num_spec_tokens: int = field(init=False, default=0)
    # forced tokens were appended to the sequence after this entry was scheduled (LLMEngine.accept_tokens): the
    # token it samples is dropped (it follows the wrong position), and it leaves no pending token
    discard: bool = field(init=False, default=False)

    def __post_init__(self):
        self.num_spec_tokens = len(self.seq.spec_token_ids)
        self.sample = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + self.num_spec_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]        # running sequences first (in running order), then resumed, then admitted
    num_batched_tokens: int
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu_block, gpu_block)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu_block, cpu_block)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_copy or self.blocks_to_swap_in or self.blocks_to_swap_out)


def _remove(queue: list[Sequence] | deque[Sequence], seq: Sequence) -> None:
    # By identity: Sequence is a dataclass, so == would compare every field.
    for i, other in enumerate(queue):
        if other is seq:
            del queue[i]
            return


class Scheduler:
    def __init__(self, config: "SchedulerConfig", block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()     # preempted into the CPU tier, oldest first
        self.num_preemptions_total = 0
        self.num_swap_preemptions_total = 0         # of those, swapped to the CPU tier (the rest recompute)

    def add_sequence(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting) + self.running + list(self.swapped):
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        _remove(self.running, seq)
        _remove(self.waiting, seq)
        _remove(self.swapped, seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        # 1. Running sequences (decodes and unfinished prefill chunks), oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            if seq.spec_token_ids and num_new < 1 + len(seq.spec_token_ids):   # proposals only verify together
                seq.spec_token_ids = []
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0 or self._ends_with_pending_token(seq):
                i += 1
                continue
            while not bm.allocate_slots(seq, num_new):
                if seq.spec_token_ids:      # proposals never preempt a sequence: without them it may fit
                    seq.spec_token_ids = []
                    num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    continue
                # Everything before index i is already scheduled, so the last entry is the newest unscheduled one.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1

        # 2. Swapped sequences, oldest first, before any new one; none when blocks just ran out.
        while not preempted and self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break
            if not self._lora_fits(seq) or not bm.swap_in(seq, num_new):
                break
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

        # 3. Waiting sequences in FIFO order; none when blocks just ran out or swapped ones still wait.
        while (not preempted and not self.swapped and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not self._lora_fits(seq):        # FIFO: it waits for an adapter's sequences to finish
                break
            computed = bm.get_computed_blocks(seq)
            num_computed = len(computed) * bm.block_size
            remaining = seq.num_tokens - num_computed
            num_new = min(remaining, budget)
            if not self.config.enable_chunked_prefill and num_new < remaining:
                break
            if not bm.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

        swap_in, swap_out = bm.take_swaps()
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted=preempted,
            blocks_to_copy=bm.take_copies(),
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=swap_out,
        )

    def _lora_fits(self, seq: Sequence) -> bool:
        """Running it keeps the running sequences within max_loras distinct LoRA adapters (the device slots)."""
        limit = self.config.max_loras
        if not limit or not seq.lora_id:
            return True
        active = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in active or len(active) < limit

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """A token still in flight reaches max_tokens or max_model_len: the sequence ends when it lands, so a
        look-ahead step must not forward it (one wasted token per request otherwise)."""
        if not seq.num_pending_tokens:
            return False
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and seq.num_output_tokens >= max_tokens) or \
            seq.num_tokens >= self.config.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        seq.spec_token_ids = []
        self.num_preemptions_total += 1
        # Swap into the CPU tier when it has room: the sequence later continues exactly where it stopped.
        if self.block_manager.swap_out(seq):
            self.num_swap_preemptions_total += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)     # victims go newest first, so the oldest ends up at the head
            return
        # Recompute: drop the KV; the prefix cache may still hold the freed blocks when it is readmitted.
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, output: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """A step's results: advance() then apply_tokens(). -> the sequences it finished."""
        self.advance(output)
        return [seq for seq, _ in self.apply_tokens(output, sampled) if seq.is_finished]

    def advance(self, output: SchedulerOutput) -> None:
        """What a launched step computes, applied before its tokens are known, so that the next step can be
        scheduled on it: computed counts, full-block hashes, and one pending token per sampling entry."""
        for item in output.scheduled:
            seq = item.seq
            item.advanced = seq.status == SequenceStatus.RUNNING   # not if aborted or finished since schedule()
            if item.advanced:
                # of a speculating entry only the last known token counts now; apply_tokens adds the accepted ones
                seq.num_computed_tokens += item.num_new_tokens - item.num_spec_tokens
                self.block_manager.cache_full_blocks(seq)
                seq.num_pending_tokens += item.sample and not item.discard

    def apply_tokens(self, output: SchedulerOutput, sampled: list[int | list[int] | None]
                     ) -> list[tuple[Sequence, int]]:
        """The advanced step's tokens: each replaces its pending token and may end the sequence. A sequence that
        ended meanwhile (aborted, a stop string) drops it; a preempted one keeps it. A speculating entry gets the
        list of tokens its verification emitted. -> the (seq, token) applied"""
        assert len(sampled) == len(output.scheduled)
        applied = []
        for item, token in zip(output.scheduled, sampled):
            seq = item.seq
            if not item.advanced or item.discard:
                continue
            assert (token is None) != item.sample, f"{seq.request_id}: sampled {token} for sample={item.sample}"
            if token is None:
                continue
            seq.num_pending_tokens -= 1
            if seq.is_finished:
                continue
            if isinstance(token, list):
                applied += self._apply_verified(item, token)
                continue
            applied.append(self._append(seq, token))
        return applied

    def apply_forced(self, seq: Sequence, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """Tokens the grammar forces after the sequence's last one, appended without being sampled (their KV is
        computed by its next step, as a chunk); each may end it (max_tokens, stop token ids). -> the (seq, token)
        applied."""
        applied = []
        for token in tokens:
            if seq.is_finished:
                break
            applied.append(self._append(seq, token))
        return applied

    def _append(self, seq: Sequence, token: int) -> tuple[Sequence, int]:
        """One known token onto the sequence, which it may end (EOS, stop ids, max_tokens)."""
        seq.append_token(token)
        reason = self._check_stop(seq, token)
        if reason is not None:
            self.finish(seq, *reason)
        return seq, token

    def _apply_verified(self, item: ScheduledSeq, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """A speculating entry's emitted tokens: the accepted proposals (their K/V, computed by the step, stay valid)
        and the target's own last token. Stops at the first token that ends the sequence; then the blocks past the
        computed tokens (the rejected proposals' slots) go back to the pool."""
        seq = item.seq
        seq.spec_token_ids = []
        applied = []
        for j, token in enumerate(tokens):
            seq.append_token(token)
            applied.append((seq, token))
            reason = self._check_stop(seq, token)
            if reason is not None:      # the accepted tokens before it were computed: their full blocks are cached
                self.block_manager.cache_full_blocks(seq)
                self.finish(seq, *reason)
                return applied
            if j < len(tokens) - 1:
                seq.num_computed_tokens += 1
        self.block_manager.trim(seq)
        self.block_manager.cache_full_blocks(seq)
        return applied

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        params = seq.params
        # EOS and stop tokens may only end the sequence once min_tokens other tokens exist (the sampler masks them).
        past_min = seq.num_output_tokens > params.min_tokens
        if token in seq.eos_token_ids and not params.ignore_eos and past_min:
            return "stop", None
        if token in params.stop_token_ids and past_min:
            return "stop", token
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length", None
        if seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None
