"""When a sequence stops asking for proposals. Pure Python."""
from dataclasses import dataclass, field

from quant_serve.engine.core.sequence import Sequence

MAX_BACKOFF_STEPS = 32


@dataclass
class _Record:
    num_tokens: int = 0                  # the sequence's tokens when its last proposals were made
    proposals: list[int] = field(default_factory=list)
    misses: int = 0                      # verifications in a row that accepted nothing
    skip: int = 0                        # steps left without proposals


class Backoff:
    """Per sequence: after `after` verifications in a row that accepted nothing, no proposals for 1, 2, 4, ...
    MAX_BACKOFF_STEPS steps, so that text where nothing is accepted decodes at (nearly) the plain speed. What was
    accepted is read from the tokens: the proposals' common prefix with the tokens emitted after them (the token the
    target emits in place of a rejected proposal always differs from it)."""

    def __init__(self, after: int):
        self.after = after
        self.records: dict[str, _Record] = {}

    def allow(self, seq: Sequence) -> bool:
        if not self.after:
            return True
        rec = self.records.setdefault(seq.request_id, _Record())
        if rec.proposals:
            emitted = seq.token_ids[rec.num_tokens:rec.num_tokens + len(rec.proposals)]
            accepted = next((i for i, (a, b) in enumerate(zip(rec.proposals, emitted)) if a != b), len(emitted))
            rec.misses = 0 if accepted else rec.misses + 1
            if rec.misses >= self.after:
                rec.skip = min(MAX_BACKOFF_STEPS, 2 ** (rec.misses - self.after))
            rec.proposals = []
        if rec.skip:
            rec.skip -= 1
            return False
        return True

    def proposed(self, seq: Sequence) -> None:
        """seq's proposals go to verification: called by the engine for the entries a verification step scheduled,
        not by the proposer, so that proposals the scheduler drops (it drops them rather than preempt) count as
        neither hit nor miss."""
        if self.after and seq.spec_token_ids:
            rec = self.records[seq.request_id]
            rec.num_tokens, rec.proposals = len(seq.token_ids), list(seq.spec_token_ids)

    def release(self, request_id: str) -> None:
        self.records.pop(request_id, None)
