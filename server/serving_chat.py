"""POST /v1/chat/completions: the chat template (chat_template.py), n, stop, logprobs / top_logprobs, streaming that
opens each choice with the role."""
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from quant_serve.server.protocol import (APIError, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                         ChatCompletionStreamResponse, ChatLogProbs, ChatResponseMessage,
                                         ChatStreamChoice, PromptTokensDetails, UsageInfo, random_id)
from quant_serve.server.serving import (SSE_DONE, ServingContext, make_sampling_params, sse, sse_error,
                                        unless_disconnected)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    arrival = time.time()
    req.validate_request()
    model = ctx.check_model(req.model)
    ctx.check_n(req.n)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    # The template already holds any special tokens the model wants.
    token_ids = await ctx.run(ctx.chat.encode, req.messages, req.add_generation_prompt, req.continue_final_message,
                              req.chat_template, req.chat_template_kwargs)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = ctx.resolve_max_tokens(requested, len(token_ids), "messages")
    num_top = req.top_logprobs or 0
    params = make_sampling_params(req, max_tokens, ctx.vocab_size, logprobs=num_top if req.logprobs else None)
    request_id = random_id("chatcmpl")
    stream = ctx.submit([(request_id, token_ids, params)], req.n, arrival, "n")
    if req.stream:
        return StreamingResponse(_stream(ctx, req, model, request_id, stream), media_type="text/event-stream")
    try:
        out = await unless_disconnected(raw, _last(stream))
    finally:
        stream.close()
    choices = []
    for c in out.outputs:
        logprobs = ChatLogProbs(content=ctx.chat_logprobs(c.logprobs or [], num_top)) if req.logprobs else None
        choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    usage = UsageInfo(prompt_tokens=len(token_ids), completion_tokens=completion_tokens,
                      total_tokens=len(token_ids) + completion_tokens,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


async def _last(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, model: str, request_id: str, stream):
    created = int(time.time())
    num_top = req.top_logprobs or 0
    done: set[int] = set()
    usage = UsageInfo(prompt_tokens_details=PromptTokensDetails())
    try:
        # Each choice opens with the role and empty content, as OpenAI and vLLM send it.
        for index in range(req.n):
            choice = ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""})
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))
        async for out in stream:
            for c in out.outputs:
                if c.index in done:
                    continue
                usage.completion_tokens += len(c.delta_token_ids)
                carries_logprobs = bool(req.logprobs and c.delta_logprobs)
                if not (c.delta_text or c.finished or carries_logprobs):
                    continue    # text held back by a possible stop string: no empty (or role-only) chunk
                delta = {"content": c.delta_text}
                if c.finished:
                    done.add(c.index)
                logprobs = ChatLogProbs(content=ctx.chat_logprobs(c.delta_logprobs or [], num_top)) \
                    if req.logprobs else None
                choice = ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                       choices=[choice]))
            if out.finished:
                usage.prompt_tokens = len(out.prompt_token_ids)
                usage.prompt_tokens_details.cached_tokens = out.num_cached_tokens
        if req.stream_options and req.stream_options.include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                                   usage=usage))
    except Exception as e:
        yield sse_error(e)
    finally:
        stream.close()
    yield SSE_DONE
