"""A launched step's state between the model runner and the engine: what it samples, its pending tokens, and the
tokens it carries into the step launched behind it (async scheduling)."""
from dataclasses import dataclass

import torch

from quant_serve.engine.sample.sampler import PendingSample
from quant_serve.engine.core.scheduler import SchedulerOutput
from quant_serve.engine.core.sequence import Logprob, Sequence


@dataclass
class Carry:
    """Tokens a step in flight samples, as inputs of the step launched behind it."""
    tokens: torch.Tensor                 # [S] int64 on the device
    rows: dict[int, int]                 # id(sequence) -> its row in tokens


@dataclass
class ForwardStep:
    """A step whose forward is queued and whose sampling is not (ModelRunner.launch_forward)."""
    samples: list[bool]                  # per scheduled entry: does it get a token
    sample_seqs: list[Sequence]          # the sequences that sample, in row order
    logits: torch.Tensor | None          # [S, vocab] on the device
    graph_sampled: torch.Tensor | None   # [S] from a decode graph that sampled inside (greedy steps)


@dataclass
class LaunchedStep:
    samples: list[bool]                  # per scheduled entry: does it get a token
    pending: PendingSample | None

    def resolve(self) -> tuple[list[int | None], list[Logprob | None]]:
        """Waits for the step: (token or None, Logprob or None) per scheduled entry."""
        sampled: list[int | None] = [None] * len(self.samples)
        logprobs: list[Logprob | None] = [None] * len(self.samples)
        if self.pending is not None:
            result = self.pending.resolve()
            rows = iter(zip(result.token_ids, result.logprobs))
            for i, sample in enumerate(self.samples):
                if sample:
                    sampled[i], logprobs[i] = next(rows)
        return sampled, logprobs

    def carry(self, out: SchedulerOutput) -> Carry | None:
        if self.pending is None:             # nothing sampled (prompt chunks only): no input to carry over
            return None
        sampling = [item.seq for item in out.scheduled if item.sample]
        return Carry(self.pending.token_ids, {id(seq): row for row, seq in enumerate(sampling)})
