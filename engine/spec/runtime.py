"""The engine's side of speculative decoding: when a step speculates, the proposals, the synchronous verification
step and its tokens. LLMEngine.step asks Speculation.active first; a step where nothing is proposed runs as usual."""
import logging

from quant_serve.engine.config import SpeculativeConfig
from quant_serve.engine.spec.proposer import make_proposer
from quant_serve.engine.spec.step import SpecStats, run_verify_step

logger = logging.getLogger("quant_serve")


class Speculation:
    def __init__(self, config: SpeculativeConfig, engine):
        self.config = config
        self.stats = SpecStats()
        self.proposer = make_proposer(config, engine)
        if config.enabled:
            logger.info("speculative decoding: %s, %d tokens per step, off above %d unfinished sequences",
                        "prompt lookup" if config.method == "ngram" else f"draft model {config.model}",
                        config.num_speculative_tokens, config.disable_by_batch_size)

    def active(self, engine) -> bool:
        """Speculation runs while few sequences are unfinished (verifying k + 1 tokens is then nearly free) and no
        forward hands its K/V to an observer."""
        if not self.config.enabled or engine.runner.observes_kv:
            return False
        sched = engine.scheduler
        return len(sched.running) + len(sched.waiting) + len(sched.swapped) <= self.config.disable_by_batch_size

    def propose_and_verify(self, engine) -> bool:
        """Proposals for the running sequences and, where any were made, a verification step. -> whether it ran."""
        if not self.proposer.propose(engine.scheduler.running):
            return False
        self._verify_step(engine)
        return True

    def _verify_step(self, engine) -> None:
        """A synchronous step that verifies the running sequences' proposals (and runs every other scheduled entry as
        usual); its tokens are emitted by the next step() call."""
        out = engine._schedule()
        if out is not None:
            for item in out.scheduled:            # only proposals verified count for the back-off
                if item.num_spec_tokens:
                    self.proposer.backoff.proposed(item.seq)
            tokens, logprobs = run_verify_step(engine.runner, out, self.stats)   # proposals are point masses
            engine.scheduler.advance(out)
            for item, lp in zip(out.scheduled, logprobs):
                if lp is not None and item.advanced and not item.seq.is_finished:
                    item.seq.output_logprobs.append(lp)
            engine._pending += engine.scheduler.apply_tokens(out, tokens)
        for seq in engine.scheduler.running:        # proposals the budget left out
            seq.spec_token_ids = []

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)
