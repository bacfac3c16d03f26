"""What the engine returns each step: one RequestOutput per request that made progress."""
from dataclasses import dataclass, field

from engine.sequence import Logprob


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
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running
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
