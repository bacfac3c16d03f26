"""One request's tokens and bookkeeping. Plain Python: the scheduler and block manager read and write it."""
from dataclasses import dataclass, field
from enum import Enum

from quant_serve.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"      # KV blocks live in the CPU tier
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # top alternatives as (token_id, logprob), best first; includes the chosen token if it ranks
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)   # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_cached_tokens: int = 0       # of the prompt, served by the prefix cache at (last) admission
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" (its grammar failed)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    output_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)  # entry 0 is None (no context)
    # Sampled by a step still in flight: counted in num_tokens (the next step is scheduled on it), not yet known.
    num_pending_tokens: int = 0
    # Proposed by speculative decoding for the next step to verify: scheduled after token_ids, not part of them.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs under (engine/lora/manager.py's id, never reused); 0 = the base model. Part of its
    # blocks' prefix-cache keys: two adapters never share K/V.
    lora_id: int = 0

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
