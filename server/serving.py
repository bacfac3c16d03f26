"""What the completion and chat handlers share: model-name and length checks, request -> SamplingParams,
logprob formatting, SSE framing and cancellation when the client goes away."""
import asyncio
import dataclasses
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

from fastapi import Request
from pydantic import BaseModel

from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.outputs import RequestOutput
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import Logprob
from quant_serve.engine.sample.structured import StructuredOutputsParams
from quant_serve.server.async_engine import AsyncEngine, QueueFullError, RequestStream
from quant_serve.server.chat_template import ChatEncoder
from quant_serve.server.protocol import (APIError, ChatLogProb, ChatLogProbEntry, CompletionLogProbs, SamplingRequest,
                                         error_body, random_id)
from quant_serve.server.tool_parsers import FORMATS, ToolCallFormat, detect_format

logger = logging.getLogger("quant_serve.server")

# Logprobs of impossible tokens are -inf, which JSON cannot carry; vLLM sends this floor instead.
LOGPROB_FLOOR = -9999.0
RETRY_AFTER_SECONDS = 1


class ClientDisconnected(Exception):
    pass


@dataclass
class ServingContext:
    engine: LLMEngine
    async_engine: AsyncEngine
    served_model_names: list[str]
    chat: ChatEncoder
    tool_call_parser: str = "auto"     # the model's tool-call format (tool_parsers.FORMATS), auto: from its template
    # Tokenizing, rendering templates and checking long token lists take the GIL-free tokenizer or plain CPU time:
    # they run here, so that one large request never holds up the event loop (health checks, other streams).
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "request-cpu"))

    def __post_init__(self):
        tokenizer = self.engine.tokenizer
        # per-token strings for logprobs; special tokens shown, as vLLM does
        self.token_str = lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    async def run(self, fn, *args):
        """fn(*args) in the request thread pool; its exceptions (APIError included) come back here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @functools.cached_property
    def tool_format(self) -> ToolCallFormat:
        if self.tool_call_parser == "auto":
            return detect_format(self.tokenizer.chat_template)
        return FORMATS[self.tool_call_parser]

    @property
    def vocab_size(self) -> int:
        """The model's (the logits' width): token ids in prompts and logit_bias must be below it."""
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> str:
        """The model a request names: a served name of the base, or a loaded LoRA adapter's (lora_name)."""
        if model is None or model == "":
            return self.served_model_names[0]
        if model not in self.served_model_names and self.lora_name(model) is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def lora_name(self, model: str) -> str | None:
        """The LoRA adapter a checked model name selects, None for the base."""
        lora = self.engine.lora
        return model if lora is not None and model not in self.served_model_names and model in lora.adapters \
            else None

    def check_n(self, n: int, param: str = "n") -> None:
        limit = self.engine.config.scheduler.max_num_seqs
        if n > limit:
            raise APIError(400, f"{param} must be at most max_num_seqs ({limit}), got {n}", param=param)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, prompt_param: str) -> int:
        """Tokens this request may generate; 400 context_length_exceeded when the prompt leaves no room or the
        requested completion does not fit."""
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise APIError(400, "the prompt is empty: at least one token is needed", param=prompt_param)
        if num_prompt_tokens >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                f"{num_prompt_tokens} tokens, which leaves no room for a generated token. Please "
                                "reduce the length of the prompt.", param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                                f"{requested} in the completion). Please reduce the length of the prompt or "
                                "completion.", param="max_tokens", code="context_length_exceeded")
        return requested

    def submit(self, prompts: list[tuple[str, list[int], SamplingParams]], n: int, arrival_time: float,
               n_param: str) -> RequestStream:
        """Queue the request's len(prompts) x n sequences. The waiting queue's cap counts sequences: a request that
        alone holds more than the cap is a 400 (n_param names what to lower); one that does not fit now, a 503."""
        limit, num_seqs = self.async_engine.max_queued_requests, len(prompts) * n
        if limit is not None and num_seqs > limit:
            param = "prompt" if len(prompts) > 1 else n_param
            raise APIError(400, f"this request holds {num_seqs} sequences (prompts x n), more than the server's "
                                f"waiting queue takes ({limit}, --max-queued-requests); split it", param=param)
        try:
            return self.async_engine.add_requests(prompts, n=n, arrival_time=arrival_time)
        except QueueFullError as e:
            raise APIError(503, str(e), type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from e

    # ---- logprobs ----------------------------------------------------------------------------------------
    def completion_logprobs(self, token_ids: list[int], logprobs: list[Logprob | None], num_top: int,
                            text_offset: int = 0) -> CompletionLogProbs:
        """The legacy completions format that lm-eval reads: one entry per token; None for a token without
        context (the first prompt token). top_logprobs holds the num_top best plus the chosen token."""
        result = CompletionLogProbs()
        for token_id, lp in zip(token_ids, logprobs):
            text = self.token_str(token_id)
            result.tokens.append(text)
            result.text_offset.append(text_offset)
            text_offset += len(text)
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            top = {self.token_str(t): max(v, LOGPROB_FLOOR) for t, v in lp.top[:num_top]}
            top[text] = max(lp.logprob, LOGPROB_FLOOR)
            result.token_logprobs.append(max(lp.logprob, LOGPROB_FLOOR))
            result.top_logprobs.append(top)
        return result

    def chat_logprobs(self, logprobs: list[Logprob], num_top: int) -> list[ChatLogProbEntry]:
        def item(token_id: int, value: float) -> ChatLogProb:
            text = self.token_str(token_id)
            return ChatLogProb(token=text, logprob=max(value, LOGPROB_FLOOR), bytes=list(text.encode("utf-8")))

        return [ChatLogProbEntry(**item(lp.token_id, lp.logprob).model_dump(),
                                 top_logprobs=[item(t, v) for t, v in lp.top[:num_top]])
                for lp in logprobs]


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    parsed = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        parsed[token_id] = value
    return parsed


def make_sampling_params(req: SamplingRequest, max_tokens: int, vocab_size: int, logprobs: int | None = None,
                         prompt_logprobs: int | None = None,
                         structured_outputs: StructuredOutputsParams | None = None,
                         lora_name: str | None = None) -> SamplingParams:
    logit_bias = parse_logit_bias(req.logit_bias, vocab_size)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias, structured_outputs=structured_outputs, lora_name=lora_name)
    except ValueError as e:
        # SamplingParams messages start with the field name
        name = str(e).split(" ", 1)[0]
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        raise APIError(400, str(e), param=name if name in fields else None) from e


def raise_if_failed(out: RequestOutput, param: str | None) -> None:
    """A sequence whose grammar failed during generation (finish_reason "error", the library's message in
    stop_reason) ends its request with an error, never with output that may break the constraint. 422, not 500:
    the request was well-formed and the server is fine, but its constraint cannot be followed within the grammar
    library's limits, and SDKs retry a 5xx (the openai SDK twice), which would only fail the same way again."""
    for c in out.outputs:
        if c.finish_reason == "error":
            raise APIError(422, f"{param or 'the output constraint'} failed during generation: {c.stop_reason}",
                           param=param, code="structured_output_failed")


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def internal_error_body(e: BaseException, where: str) -> dict:
    """A 5xx never shows the exception to the client (it may hold paths, prompts of other requests, internals):
    the log gets it under an error id, the client gets the id."""
    error_id = random_id("err")
    logger.error("%s failed (error id %s): %r", where, error_id, e, exc_info=e)
    return error_body(f"internal server error (error id {error_id}; the server log has the details)",
                      "server_error", code="internal_error")


def sse_error(e: Exception) -> str:
    """An error after the stream started (the status line is gone): an error event, then [DONE]."""
    if isinstance(e, APIError):
        return sse(error_body(e.message, e.type, e.param, e.code))
    return sse(internal_error_body(e, "a streamed request"))


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw: Request, coro):
    """Await coro unless the client hangs up first; then cancel it and raise ClientDisconnected. The caller
    closes its RequestStream in a finally block, which aborts the engine requests."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return work.result()
    raise ClientDisconnected()
