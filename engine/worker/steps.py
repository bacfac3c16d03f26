"""A launched step's state between the model runner and the engine: what it samples, its pending tokens, and the
tokens it carries into the step launched behind it (async scheduling)."""
from dataclasses import dataclass, field
from typing import Any

import numpy as np
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
class PreparedForward:
    """A forward whose inputs are ready on the host (their copies queued) and which is not queued yet
    (ModelRunner.prepare_forward): the fields its path needs."""
    out: SchedulerOutput
    path: str                            # "verify graph" | "decode graph" | "eager"
    greedy: bool
    first_observer: Any = None           # the first forward's K/V range check
    starts: list[int] | None = None      # row starts
    packed: np.ndarray | None = None     # graph inputs
    bucket: Any = None                   # verify graph
    shape: tuple[int, int] | None = None     # decode graph
    carries: bool = False                # decode graph: a row's input is a carried token
    input_ids: torch.Tensor | None = None    # eager
    positions: torch.Tensor | None = None
    meta: Any = None
    fill: tuple[torch.Tensor, torch.Tensor] | None = None    # eager: (input positions, rows of the carried samples)
    lora_slots: Any = None               # eager: each row's LoRA slot [T] int32 (-1: base); None: no adapter


@dataclass
class PreparedStep:
    """A step whose forward is prepared and not queued (ModelRunner.prepare_step)."""
    samples: list[bool]                  # per scheduled entry: does it get a token
    sample_seqs: list[Sequence]
    argmax_only: bool
    forward: PreparedForward


def carry_rows(out: SchedulerOutput) -> dict[int, int]:
    """id(sequence) -> its row in the samples of a step (the sequences that sample, in order)."""
    return {id(item.seq): row for row, item in enumerate(i for i in out.scheduled if i.sample)}


@dataclass
class ForwardStep:
    """A step whose forward is queued and whose sampling is not (ModelRunner.launch_forward)."""
    samples: list[bool]                  # per scheduled entry: does it get a token
    sample_seqs: list[Sequence]          # the sequences that sample, in row order
    logits: torch.Tensor | None          # [S, vocab] on the device
    graph_sampled: torch.Tensor | None   # [S] from a decode graph that sampled inside (greedy steps)
    dropped: set[int] = field(default_factory=set)   # ids of sequences whose token will be dropped (forced tokens)


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
        return Carry(self.pending.token_ids, carry_rows(out))
