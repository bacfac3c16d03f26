"""Draft-model proposals: a smaller model with the target's tokenizer proposes k tokens greedily, one single-token
forward each, over its own paged KV cache (as many blocks as the target's pool: the memory plan counts both).

Each speculating sequence has a shadow Sequence in the draft's block manager. Its K/V cover a prefix of the
target's tokens plus, after proposing, the draft's own proposals; after verification the shadow keeps the longest
prefix that the target's tokens still agree with (the accepted proposals) and gives back the blocks past it."""
import logging

import torch

from quant_serve.engine.block_manager import BlockManager
from quant_serve.engine.config import CacheConfig, SpeculativeConfig
from quant_serve.engine.loader import load_model, load_model_config, load_tokenizer, resolve_model_dir
from quant_serve.engine.model_runner import ModelRunner
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.scheduler import ScheduledSeq, SchedulerOutput
from quant_serve.engine.sequence import Sequence, SequenceStatus
from quant_serve.engine.spec.backoff import Backoff
from quant_serve.engine.spec.step import num_to_propose
from quant_serve.engine.warmup import warm_up

logger = logging.getLogger("quant_serve")


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_dir) -> None:
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError(f"draft model {draft_dir} has a different tokenizer vocabulary than the target model: "
                         "speculative decoding needs the same tokenizer")


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, target):
        self.config = config
        self.max_model_len = target.max_model_len
        self.max_num_batched_tokens = target.config.scheduler.max_num_batched_tokens
        self.model_dir = resolve_model_dir(config.model)
        self.model_config, _ = load_model_config(self.model_dir)
        check_same_tokenizer(target.tokenizer, load_tokenizer(str(self.model_dir)), self.model_dir)
        if self.model_config.max_position_embeddings < target.max_model_len:
            raise ValueError(f"draft model {self.model_dir} has {self.model_config.max_position_embeddings} "
                             f"positions, fewer than max_model_len {target.max_model_len}")
        self.model, _ = load_model(self.model_dir, self.model_config, target.dtype, target.device,
                                   target.config.load_format, None, False, target.config.seed)
        num_blocks = target.num_blocks
        cache = CacheConfig(block_size=target.config.cache.block_size, kv_cache_dtype="auto")
        self.runner = ModelRunner(self.model, self.model_config, cache, num_blocks, target.device, target.dtype,
                                  target.config.seed)
        self.block_manager = BlockManager(num_blocks, cache.block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Sequence] = {}
        self.synced: dict[str, int] = {}        # request id -> target tokens the shadow was last synced with
        self.backoff = Backoff(config.backoff_after)
        if target.device != "cpu":       # compile before the first request; decode graphs for proposals 2..k
            sched = target.config.scheduler
            if not target.config.enforce_eager:
                self.runner.plan_decode_graphs(min(sched.max_num_seqs, 512), target.max_model_len)
            warm_up(self.runner, sched.max_num_batched_tokens, sched.max_num_seqs, target.max_model_len)
            if not target.config.enforce_eager:
                self.runner.capture_decode_graphs()
        logger.info("draft model %s: %d KV blocks", self.model_dir, num_blocks)

    def _shadow(self, seq: Sequence) -> Sequence:
        """The draft's copy of seq, its K/V kept for the prefix the target's tokens still agree with."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, SamplingParams(max_tokens=None))
            shadow.status = SequenceStatus.RUNNING
            self.shadows[seq.request_id] = shadow
        # the target's tokens at the last sync still match (they only grow); compare from there
        limit = min(shadow.num_computed_tokens, len(seq.token_ids))
        common = min(self.synced.get(seq.request_id, 0), limit)
        while common < limit and shadow.token_ids[common] == seq.token_ids[common]:
            common += 1
        shadow.token_ids = list(seq.token_ids)
        self.synced[seq.request_id] = len(seq.token_ids)
        shadow.num_computed_tokens = common
        self.block_manager.trim(shadow)
        return shadow

    def _drop(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id)
        self.synced.pop(request_id, None)
        self.block_manager.free(shadow)

    def propose(self, running: list[Sequence]) -> bool:
        """Sets spec_token_ids of the running sequences that can speculate. -> whether any did."""
        alive = {seq.request_id for seq in running}
        for request_id in [r for r in self.shadows if r not in alive]:   # finished, aborted or preempted
            self._drop(request_id)
        wanted: list[tuple[Sequence, Sequence, int]] = []
        for seq in running:
            seq.spec_token_ids = []
            k = num_to_propose(seq, self.config.num_speculative_tokens, self.max_model_len)
            if k and self.backoff.allow(seq):
                wanted.append((seq, self._shadow(seq), k))
        batch = []
        for seq, shadow, k in wanted:
            # room for the proposals' K/V too (k - 1 of them are forwarded); a full pool: no proposal
            if self.block_manager.allocate_slots(shadow, seq.num_tokens - shadow.num_computed_tokens + k - 1):
                batch.append((seq, shadow, k))
            else:
                self._drop(seq.request_id)
        self._catch_up([shadow for _, shadow, _ in batch])
        for step in range(max((k for _, _, k in batch), default=0)):
            active = [(seq, shadow) for seq, shadow, k in batch if k > step]
            out = SchedulerOutput([ScheduledSeq(shadow, shadow.num_tokens - shadow.num_computed_tokens)
                                   for _, shadow in active], 0)
            tokens = self._forward_argmax(out)
            for (seq, shadow), token in zip(active, tokens):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.append_token(token)
                seq.spec_token_ids.append(token)
        return any(seq.spec_token_ids for seq, _, _ in batch)

    @torch.inference_mode()
    def _catch_up(self, shadows: list[Sequence]) -> None:
        """While the shadows' uncomputed tokens exceed the step's token budget (what the draft's warmup and the memory
        plan sized its activations for; a first proposal for long prompts), forwards all but each one's last in
        chunks of at most the budget. Within it (the usual 1 or 2 tokens) the first proposal forward takes them."""
        budget = self.max_num_batched_tokens
        while sum(shadow.num_tokens - shadow.num_computed_tokens for shadow in shadows) > budget:
            chunk, left = [], budget
            for shadow in shadows:
                n = min(shadow.num_tokens - 1 - shadow.num_computed_tokens, left)
                if n > 0:
                    chunk.append(ScheduledSeq(shadow, n))
                    left -= n
            if not chunk:
                return
            self.runner.forward(SchedulerOutput(chunk, 0))
            for item in chunk:
                item.seq.num_computed_tokens += item.num_new_tokens

    @torch.inference_mode()
    def _forward_argmax(self, out: SchedulerOutput) -> list[int]:
        hidden, starts, _ = self.runner.forward(out)                                             # [T, hidden]
        rows = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden[rows])                                         # [S, vocab]
        return logits.argmax(dim=-1).tolist()

    def release(self, request_id: str) -> None:
        """The target sequence ended: its shadow's blocks go back to the draft's pool."""
        self.backoff.release(request_id)
        if request_id in self.shadows:
            self._drop(request_id)
