"""One verification step on the target model: the scheduled tokens (speculating decodes carry 1 + k inputs: the
last known token and k proposals) in one forward, then acceptance per speculating entry and ordinary sampling for
the rest (prompt chunks, decodes that do not speculate). Runs synchronously: the step after it is scheduled only
once its accepted tokens are on the host."""
from dataclasses import dataclass, field

import torch

from quant_serve.engine.sample.sampler import _is_greedy, needs_last_token_on_host, sampling_probs
from quant_serve.engine.core.scheduler import SchedulerOutput
from quant_serve.engine.core.sequence import Logprob, Sequence
from quant_serve.engine.spec.verify import accept_greedy, accept_sampled
from quant_serve.engine.worker.transfer import to_device


def can_speculate(seq: Sequence) -> bool:
    """Rows whose next-token distribution depends only on the logits (no penalties, bias, min_tokens, grammar) and
    that want no logprobs: their verification needs nothing but the target's probabilities."""
    p = seq.params
    return not needs_last_token_on_host(seq) and not p.logit_bias and p.logprobs is None


def num_to_propose(seq: Sequence, k: int, max_model_len: int) -> int:
    """At most k, and never past max_tokens or max_model_len: the step emits up to (proposals + 1) tokens."""
    if seq.num_pending_tokens or seq.num_computed_tokens != seq.num_tokens - 1 or not can_speculate(seq):
        return 0        # only a decode whose tokens are all on the host
    room = max_model_len - seq.num_tokens - 1
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(k, room))


@dataclass
class SpecStats:
    """Counters under vLLM's spec-decode metric names (vllm:spec_decode_*)."""
    num_drafts: int = 0                  # verified proposals (one per speculating entry)
    num_draft_tokens: int = 0            # proposed tokens verified
    num_accepted_tokens: int = 0         # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: accepted at draft position i

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_proposed:
            self.accepted_per_pos += [0] * (num_proposed - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculating entry and step (accepted + the target's own): 1.0 = no gain."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@torch.inference_mode()
def run_verify_step(runner, out: SchedulerOutput, stats: SpecStats, draft_probs: dict[int, torch.Tensor] | None = None
                    ) -> tuple[list[int | list[int] | None], list[Logprob | None]]:
    """Forward + acceptance. -> per scheduled entry: a token (plain sampling), the emitted tokens (speculating), or
    None; and its Logprob or None. draft_probs: id(seq) -> [k, V] proposer probabilities (None: point masses)."""
    # [T, hidden]; all_logits [T, vocab] fp32 where a verify graph ran (its head inside), else None
    hidden, starts, all_logits = runner.forward(out, None, verify=True)
    runner._prompt_logprobs(out, hidden, starts)

    def logits_of(rows: list[int]) -> torch.Tensor:                                          # [len(rows), vocab]
        index = to_device(rows, torch.long, hidden.device)
        return all_logits[index] if all_logits is not None else runner.model.compute_logits(hidden[index])
    tokens: list[int | list[int] | None] = [None] * len(out.scheduled)
    logprobs: list[Logprob | None] = [None] * len(out.scheduled)
    plain = [i for i, item in enumerate(out.scheduled) if item.sample and not item.num_spec_tokens]
    spec = [i for i, item in enumerate(out.scheduled) if item.num_spec_tokens]
    if plain:
        result = runner.sampler.sample(logits_of([starts[i + 1] - 1 for i in plain]),
                                       [out.scheduled[i].seq for i in plain]).resolve()
        for i, token, lp in zip(plain, result.token_ids, result.logprobs):
            tokens[i], logprobs[i] = token, lp
    if not spec:
        return tokens, logprobs
    rows, spans = [], []
    for i in spec:
        k = out.scheduled[i].num_spec_tokens
        spans.append((len(rows), k))
        rows += range(starts[i + 1] - 1 - k, starts[i + 1])
    logits = logits_of(rows)                                                                    # [sum(k+1), V] fp32
    greedy = [_is_greedy(out.scheduled[i].seq) for i in spec]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
    for i, (row0, k), is_greedy in zip(spec, spans, greedy):
        seq = out.scheduled[i].seq
        draft = seq.spec_token_ids
        assert len(draft) == k, (seq.request_id, len(draft), k)
        if is_greedy:
            emitted = accept_greedy(argmax[row0:row0 + k + 1], draft)
        else:
            probs = sampling_probs(logits[row0:row0 + k + 1], [seq] * (k + 1))                  # [k + 1, V]
            q = None if draft_probs is None else draft_probs.get(id(seq))
            emitted = accept_sampled(probs, draft, q, runner.sampler.generator_for(seq, logits.device))
        stats.record(k, len(emitted) - 1)
        tokens[i] = emitted
    return tokens, logprobs
