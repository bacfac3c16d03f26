"""What the engine returns each step (one RequestOutput per request that made progress), the request record it is
built from, and the engine's counters."""
from dataclasses import dataclass, field

from quant_serve.engine.core.detokenizer import IncrementalDetokenizer
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import Logprob, Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str                      # full text so far (final text once finished)
    token_ids: list[int]           # all generated token ids so far
    delta_text: str = ""           # text that became safe to emit in this step
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    delta_logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[Logprob | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class Request:
    """One user request: n sequences sharing a prompt."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    emitted_logprobs: list[int] = field(default_factory=list)   # per sequence: logprobs already returned

    def output(self, deltas: dict[tuple[str, int], tuple[str, list[int]]]) -> RequestOutput:
        """The RequestOutput after a step; deltas: (request id, sequence index) -> (new text, new token ids)."""
        outputs = []
        want_lp = self.params.logprobs is not None
        for i, (seq, detok) in enumerate(zip(self.seqs, self.detokenizers)):
            delta_text, delta_ids = deltas.get((self.request_id, i), ("", []))
            new_lps = seq.output_logprobs[self.emitted_logprobs[i]:] if want_lp else None
            self.emitted_logprobs[i] = len(seq.output_logprobs)
            outputs.append(CompletionOutput(
                index=i, text=detok.output_text, token_ids=seq.output_token_ids, delta_text=delta_text,
                delta_token_ids=delta_ids, logprobs=list(seq.output_logprobs) if want_lp else None,
                delta_logprobs=new_lps,
                cumulative_logprob=sum(lp.logprob for lp in seq.output_logprobs) if want_lp else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        first = self.seqs[0]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             all(seq.is_finished for seq in self.seqs),
                             prompt_logprobs=first.prompt_logprobs if self.params.prompt_logprobs is not None else None,
                             num_cached_tokens=first.num_cached_tokens, metrics=self.metrics)


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    requests_finished_total: int = 0
    swapped_out_blocks_total: int = 0      # KV blocks copied GPU -> CPU tier (preemption or prefix eviction)
    swapped_in_blocks_total: int = 0       # KV blocks copied CPU tier -> GPU (resume or CPU prefix hit)
    swap_bytes_total: int = 0
    cpu_prefix_hits_total: int = 0         # blocks served from the CPU tier by prefix hits
    structured_forced_tokens_total: int = 0    # tokens a grammar forced, appended without a forward each
