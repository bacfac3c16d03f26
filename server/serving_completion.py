"""POST /v1/completions: several prompts (strings or token ids), n / best_of, echo with prompt logprobs (what lm-eval's
local-completions reads), max_tokens=0 for scoring, streaming."""
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from quant_serve.engine.outputs import CompletionOutput, RequestOutput
from quant_serve.engine.sample.structured import StructuredOutputsParams
from quant_serve.server.protocol import (APIError, CompletionChoice, CompletionRequest, CompletionResponse,
                                         PromptTokensDetails, UsageInfo, random_id)
from quant_serve.server.serving import (SSE_DONE, ServingContext, make_sampling_params, raise_if_failed, sse,
                                        sse_error, unless_disconnected)
from quant_serve.server.structured_request import compile_or_400, requested_constraint


@dataclass
class _Prompt:
    request_id: str
    text: str | None       # None when given as token ids (decoded lazily for echo)
    token_ids: list[int]


def _prompts(ctx: ServingContext, req: CompletionRequest, base_id: str) -> list[_Prompt]:
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    vocab = ctx.vocab_size
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            text = item
        else:
            ids, text = list(item), None
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        prompts.append(_Prompt(f"{base_id}-{i}", text, ids))
    return prompts


def _constraint(ctx: ServingContext, req: CompletionRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """(response_format or vLLM's guided_* / structured_outputs, compiled (a 400 naming the parameter otherwise),
    the parameter)."""
    constraint, param = requested_constraint(req)
    if constraint is not None:
        compile_or_400(ctx.engine.grammar_compiler, constraint, param)
    return constraint, param


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request):
    arrival = time.time()
    req.validate_request()
    model = ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    n = req.n
    best_of = req.best_of or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if req.stream and best_of > n:
        raise APIError(400, "best_of > n cannot be streamed", param="best_of")
    ctx.check_n(best_of, "best_of" if req.best_of else "n")
    echo = bool(req.echo)
    if req.max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
    scoring_only = req.max_tokens == 0
    # best_of ranks sequences by cumulative logprob, so it needs logprobs even when the client asked for none.
    logprobs = req.logprobs if req.logprobs is not None else (0 if best_of > n else None)
    prompt_logprobs = req.logprobs if echo and req.logprobs is not None else None

    request_id = random_id("cmpl")
    constraint, constraint_param = await ctx.run(_constraint, ctx, req)
    prompts = await ctx.run(_prompts, ctx, req, request_id)
    submissions = []
    for p in prompts:
        # The engine generates at least one token; for max_tokens=0 it is dropped from the answer.
        max_tokens = ctx.resolve_max_tokens(1 if scoring_only else req.max_tokens, len(p.token_ids), "prompt")
        params = make_sampling_params(req, max_tokens, ctx.vocab_size, logprobs, prompt_logprobs, constraint,
                                      lora_name=ctx.lora_name(model))
        submissions.append((p.request_id, p.token_ids, params))
    stream = ctx.submit(submissions, best_of, arrival, "best_of" if req.best_of else "n")
    builder = _ChoiceBuilder(ctx, req, prompts, n, scoring_only)
    if req.stream:
        return StreamingResponse(_stream(ctx, req, model, request_id, stream, builder, constraint_param),
                                 media_type="text/event-stream")
    try:
        finals = await unless_disconnected(raw, _collect(stream, constraint_param))
    finally:
        stream.close()
    # echoed prompts and their logprobs can be long: the answer and its JSON are built in the thread pool
    return await ctx.run(_response, builder, finals, request_id, model, best_of)


def _response(builder: "_ChoiceBuilder", finals: dict[str, RequestOutput], request_id: str, model: str,
              best_of: int) -> Response:
    prompts, n = builder.prompts, builder.n
    choices, usage = [], UsageInfo(prompt_tokens_details=PromptTokensDetails())
    for i, p in enumerate(prompts):
        out = finals[p.request_id]
        ranked = out.outputs
        if best_of > n:
            ranked = sorted(ranked, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:n]
        for j, c in enumerate(ranked):
            choice, num_tokens = builder.choice(i, j, c, out, first=True, final=True)
            choices.append(choice)
            usage.completion_tokens += num_tokens
        usage.prompt_tokens += len(p.token_ids)
        usage.prompt_tokens_details.cached_tokens += out.num_cached_tokens
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    response = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return Response(response.model_dump_json(), media_type="application/json")


async def _collect(stream, constraint_param: str | None) -> dict[str, RequestOutput]:
    finals = {}
    async for out in stream:
        raise_if_failed(out, constraint_param)
        if out.finished:
            finals[out.request_id] = out
    return finals


class _ChoiceBuilder:
    """Turns one CompletionOutput (whole or a streamed delta) into a CompletionChoice."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[_Prompt], n: int,
                 scoring_only: bool):
        self.ctx, self.req, self.prompts, self.n = ctx, req, prompts, n
        self.scoring_only = scoring_only
        self.text_offsets: dict[int, int] = {}

    def prompt_text(self, p: _Prompt) -> str:
        if p.text is None:
            p.text = self.ctx.tokenizer.decode(p.token_ids)
        return p.text

    def choice(self, prompt_index: int, j: int, c: CompletionOutput, out: RequestOutput, first: bool,
               final: bool) -> tuple[CompletionChoice, int]:
        """Returns the choice and how many generated tokens it carries. `first`: the choice's first chunk (the
        echoed prompt goes there); `final`: c holds the whole output rather than a delta."""
        req, p = self.req, self.prompts[prompt_index]
        index = prompt_index * self.n + j
        if self.scoring_only:
            text, token_ids, lps = "", [], []
        elif final:
            text, token_ids, lps = c.text, c.token_ids, c.logprobs
        else:
            text, token_ids, lps = c.delta_text, c.delta_token_ids, c.delta_logprobs
        lp_ids, lp_values = list(token_ids), list(lps or [None] * len(token_ids))
        if first and req.echo:
            text = self.prompt_text(p) + text
            lp_ids = p.token_ids + lp_ids
            lp_values = list(out.prompt_logprobs or [None] * len(p.token_ids)) + lp_values
        logprobs = None
        if req.logprobs is not None:
            offset = self.text_offsets.get(index, 0)
            logprobs = self.ctx.completion_logprobs(lp_ids, lp_values, req.logprobs, offset)
            if logprobs.tokens:
                self.text_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        finish_reason = c.finish_reason
        stop_reason = c.stop_reason
        if self.scoring_only and c.finished:
            finish_reason, stop_reason = "length", None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                stop_reason=stop_reason), len(token_ids)


async def _stream(ctx: ServingContext, req: CompletionRequest, model: str, request_id: str, stream,
                  builder: _ChoiceBuilder, constraint_param: str | None):
    created = int(time.time())
    prompt_index = {p.request_id: i for i, p in enumerate(builder.prompts)}
    started: set[int] = set()
    done: set[int] = set()
    usage = UsageInfo(prompt_tokens_details=PromptTokensDetails())
    try:
        async for out in stream:
            raise_if_failed(out, constraint_param)       # an error event, then [DONE]
            i = prompt_index[out.request_id]
            for c in out.outputs:
                index = i * builder.n + c.index
                if index in done:
                    continue
                first = index not in started
                has_tokens = bool(c.delta_token_ids) and not builder.scoring_only
                if has_tokens:
                    usage.completion_tokens += len(c.delta_token_ids)
                if not (c.delta_text or c.finished or (first and req.echo) or
                        (has_tokens and req.logprobs is not None)):
                    continue    # nothing to show yet (text held back by a possible stop string)
                if first and req.echo:      # the echoed prompt and its logprobs: in the thread pool
                    choice, _ = await ctx.run(builder.choice, i, c.index, c, out, first, False)
                else:
                    choice, _ = builder.choice(i, c.index, c, out, first=first, final=False)
                started.add(index)
                if c.finished:
                    done.add(index)
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[choice]))
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
                usage.prompt_tokens_details.cached_tokens += out.num_cached_tokens
        if req.stream_options and req.stream_options.include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as e:
        yield sse_error(e)
    finally:
        stream.close()
    yield SSE_DONE
