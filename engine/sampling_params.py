"""Per-request generation settings, named as in vLLM / the OpenAI API."""
import math
from dataclasses import dataclass, field

from quant_serve.engine.sample.structured import StructuredOutputsParams

LOGIT_BIAS_LIMIT = 100.0     # OpenAI's range for logit_bias values; larger ones are clamped to it, as vLLM does


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None = up to max_model_len
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None          # top-k alternatives per sampled token (0 = sampled token only)
    prompt_logprobs: int | None = None   # same for prompt tokens (needed for echo)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (clamped to +-100)
    # the output follows this grammar (JSON schema, regex, choice, Lark/GBNF); a dict of its fields is accepted
    structured_outputs: StructuredOutputsParams | None = None
    lora_name: str | None = None         # a loaded LoRA adapter to generate with (--enable-lora); None = the base

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.logit_bias:
            bad = [v for v in self.logit_bias.values() if not math.isfinite(v)]
            if bad:
                raise ValueError(f"logit_bias values must be finite, got {bad[0]}")
            self.logit_bias = {int(t): min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(v)))
                               for t, v in self.logit_bias.items()}
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field (the server turns it into HTTP 400)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        negative = [t for t in (self.logit_bias or {}) if t < 0]
        if negative:
            raise ValueError(f"logit_bias token ids must be non-negative, got {negative[0]}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
