"""The engine's side of speculative decoding: when a step speculates, the proposals, the synchronous verification
step and its tokens. LLMEngine.step asks Speculation.active first; a step where nothing is proposed runs as usual."""
import logging

from quant_serve.engine.config import SpeculativeConfig
from quant_serve.engine.spec.step import SpecStats, run_verify_step

logger = logging.getLogger("quant_serve")


class Speculation:
    def __init__(self, config: SpeculativeConfig, scheduler, runner, proposer):
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.stats = SpecStats()
        self.proposer = proposer
        if config.enabled:
            logger.info("speculative decoding: %s, %d tokens per step, off above %d unfinished sequences",
                        "prompt lookup" if config.method == "ngram" else f"draft model {config.model}",
                        config.num_speculative_tokens, config.disable_by_batch_size)

    def active(self) -> bool:
        """Speculation runs while few sequences are unfinished (verifying k + 1 tokens is then nearly free) and no
        forward hands its K/V to an observer."""
        if not self.config.enabled or self.runner.observes_kv:
            return False
        sched = self.scheduler
        return len(sched.running) + len(sched.waiting) + len(sched.swapped) <= self.config.disable_by_batch_size

    def propose_and_verify(self, schedule_step, accept_tokens) -> bool:
        """Proposals for the running sequences and, where any were made, a verification step: scheduled by
        schedule_step() (the engine's), its tokens handed to accept_tokens(out, tokens, logprobs) and emitted by the
        next step() call. -> whether it ran."""
        if not self.proposer.propose(self.scheduler.running):
            return False
        out = schedule_step()
        if out is not None:
            for item in out.scheduled:            # only proposals verified count for the back-off
                if item.num_spec_tokens:
                    self.proposer.backoff.proposed(item.seq)
            tokens, logprobs = run_verify_step(self.runner, out, self.stats)   # proposals are point masses
            self.scheduler.advance(out)
            accept_tokens(out, tokens, logprobs)
        for seq in self.scheduler.running:        # proposals the budget left out
            seq.spec_token_ids = []
        return True

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
