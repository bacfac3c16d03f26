"""POST /v1/chat/completions: the chat template (chat_template.py), n, stop, logprobs / top_logprobs, structured
outputs and tool calls (structured_request.py, tool_parsers.py), streaming that opens each choice with the role."""
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from quant_serve.server.protocol import (APIError, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                         ChatCompletionStreamResponse, ChatLogProbs, ChatResponseMessage,
                                         ChatStreamChoice, PromptTokensDetails, UsageInfo, random_id)
from quant_serve.server.serving import (SSE_DONE, ServingContext, make_sampling_params, raise_if_failed, sse,
                                        sse_error, unless_disconnected)
from quant_serve.server.structured_request import ToolPlan, chat_constraint, plan_tools
from quant_serve.server.tool_parsers import ToolCallStream, extract_tool_calls


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request):
    arrival = time.time()
    req.validate_request()
    model = ctx.check_model(req.model)
    ctx.check_n(req.n)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = plan_tools(req, ctx.tool_format)
    constraint, constraint_param = await ctx.run(chat_constraint, req, plan, ctx.engine.grammar_compiler,
                                                 ctx.tokenizer)
    # The template already holds any special tokens the model wants.
    token_ids = await ctx.run(ctx.chat.encode, req.messages, req.add_generation_prompt, req.continue_final_message,
                              req.chat_template, req.chat_template_kwargs, plan.template_tools if plan else None)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = ctx.resolve_max_tokens(requested, len(token_ids), "messages")
    num_top = req.top_logprobs or 0
    params = make_sampling_params(req, max_tokens, ctx.vocab_size, logprobs=num_top if req.logprobs else None,
                                  structured_outputs=constraint, lora_name=ctx.lora_name(model))
    request_id = random_id("chatcmpl")
    stream = ctx.submit([(request_id, token_ids, params)], req.n, arrival, "n")
    parse = plan if plan is not None and plan.parse else None
    if req.stream:
        return StreamingResponse(_stream(ctx, req, model, request_id, stream, parse, constraint_param),
                                 media_type="text/event-stream")
    try:
        out = await unless_disconnected(raw, _last(stream, constraint_param))
    finally:
        stream.close()
    choices = []
    for c in out.outputs:
        logprobs = ChatLogProbs(content=ctx.chat_logprobs(c.logprobs or [], num_top)) if req.logprobs else None
        content, calls = extract_tool_calls(c.text, parse.format) if parse else (c.text, [])
        choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
                                  logprobs=logprobs, finish_reason=_finish_reason(c.finish_reason, parse, calls),
                                  stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    usage = UsageInfo(prompt_tokens=len(token_ids), completion_tokens=completion_tokens,
                      total_tokens=len(token_ids) + completion_tokens,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


def _finish_reason(reason: str | None, plan: ToolPlan | None, calls: list) -> str | None:
    """"tool_calls" when the model called tools of its own choice or as tool_choice required asked; a call of the
    function tool_choice names ends with "stop", as OpenAI answers it."""
    if reason == "stop" and calls and plan.forced in (None, "required"):
        return "tool_calls"
    return reason


async def _last(stream, constraint_param: str | None):
    last = None
    async for out in stream:
        raise_if_failed(out, constraint_param)
        last = out
    return last


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, model: str, request_id: str, stream,
                  plan: ToolPlan | None, constraint_param: str | None):
    created = int(time.time())
    num_top = req.top_logprobs or 0
    done: set[int] = set()
    usage = UsageInfo(prompt_tokens_details=PromptTokensDetails())
    calls = {index: ToolCallStream(plan.format) for index in range(req.n)} if plan else {}
    try:
        # Each choice opens with the role and empty content, as OpenAI and vLLM send it.
        for index in range(req.n):
            choice = ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""})
            yield sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=[choice]))
        async for out in stream:
            raise_if_failed(out, constraint_param)       # an error event, then [DONE]
            for c in out.outputs:
                if c.index in done:
                    continue
                usage.completion_tokens += len(c.delta_token_ids)
                carries_logprobs = bool(req.logprobs and c.delta_logprobs)
                delta = {"content": c.delta_text}
                finish_reason = c.finish_reason
                if plan is not None:          # content until a call opens, then the calls' deltas
                    parser = calls[c.index]
                    content, tool_calls = parser.feed(c.delta_text, final=c.finished)
                    delta = {"content": content} if content or not tool_calls else {}
                    if tool_calls:
                        delta["tool_calls"] = tool_calls
                    finish_reason = _finish_reason(c.finish_reason, plan, parser.sent)
                if not (delta.get("content") or delta.get("tool_calls") or c.finished or carries_logprobs):
                    continue    # text held back (a possible stop string or tool call): no empty chunk
                if c.finished:
                    done.add(c.index)
                logprobs = ChatLogProbs(content=ctx.chat_logprobs(c.delta_logprobs or [], num_top)) \
                    if req.logprobs else None
                choice = ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                          finish_reason=finish_reason, stop_reason=c.stop_reason)
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
