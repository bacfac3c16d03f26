"""Request fields -> the engine's output constraint: response_format, vLLM's guided_* fields and structured_outputs
(chat and completions), and for chat the tool plan (tools, tool_choice, parallel_tool_calls). Every constraint is
compiled here, in the request thread pool, so that one the grammar library refuses is a 400 naming its parameter
before anything is queued."""
import json
from dataclasses import dataclass

from quant_serve.engine.sample.structured import GrammarCompiler, StructuredOutputsParams, StructuredOutputsUnavailable
from quant_serve.server.protocol import (APIError, ChatCompletionRequest, NamedToolChoice, ResponseFormat,
                                         SamplingRequest)
from quant_serve.server.tool_grammar import tool_call_grammar
from quant_serve.server.tool_parsers import ToolCallFormat

GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(rf: ResponseFormat, whitespace: str | None) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True, whitespace_pattern=whitespace)
    if rf.json_schema is None:
        raise APIError(400, "response_format.json_schema is required when response_format.type is json_schema",
                       param="response_format.json_schema")
    schema = rf.json_schema.schema_
    if schema is None:                  # a named format without a schema: any JSON object
        return StructuredOutputsParams(json_object=True, whitespace_pattern=whitespace)
    return StructuredOutputsParams(json=schema, whitespace_pattern=whitespace)


def requested_constraint(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint the request asks for, the parameter that asks); 400 when several parameters ask."""
    whitespace = req.guided_whitespace_pattern
    found: list[tuple[str, StructuredOutputsParams]] = []

    def add(name: str, make) -> None:
        value = getattr(req, name)
        if value is None:
            return
        try:
            params = make(value)
        except ValueError as e:
            raise APIError(400, str(e), param=name) from e
        if params is not None:
            found.append((name, params))

    add("response_format", lambda rf: _from_response_format(rf, whitespace))
    for name, kind in GUIDED_KINDS.items():
        add(name, lambda value: StructuredOutputsParams(**{kind: value}, whitespace_pattern=whitespace))
    add("structured_outputs", StructuredOutputsParams.from_value)
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not {' and '.join(n for n, _ in found)}",
                       param=found[1][0])
    return found[0][1] if found else None, found[0][0] if found else None


def compile_or_400(compiler: GrammarCompiler, params: StructuredOutputsParams, param: str) -> None:
    try:
        compiler.compile(params)
    except StructuredOutputsUnavailable as e:
        raise APIError(400, str(e), param=param, code="structured_outputs_unavailable") from e
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


@dataclass
class ToolPlan:
    format: ToolCallFormat
    template_tools: list[dict]      # the tools as the chat template gets them (OpenAI's objects)
    parse: bool                     # tool calls are parsed out of the output (tool_choice other than none)
    forced: str | None = None       # "required", or the name of the function tool_choice names


def plan_tools(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan | None:
    choice = req.tool_choice or ("auto" if req.tools else "none")
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else \
        "required" if choice == "required" else None
    if not req.tools:
        if forced is not None:
            raise APIError(400, "tool_choice requires tools: give the functions the model may call",
                           param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise APIError(400, f"tools holds the function {duplicate!r} twice", param="tools")
    if forced is not None and forced != "required" and forced not in names:
        raise APIError(400, f"tool_choice names the function {forced!r}, which tools does not hold (it holds "
                            f"{', '.join(map(repr, names))})", param="tool_choice")
    template_tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    return ToolPlan(fmt, template_tools, parse=choice != "none", forced=forced)


def chat_constraint(req: ChatCompletionRequest, plan: ToolPlan | None, compiler: GrammarCompiler,
                    tokenizer) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the chat request's constraint, compiled (400 naming the parameter otherwise), the parameter that asks for
    it). tool_choice required or named: a grammar of calls in the model's format; auto with a JSON response format:
    that JSON or calls; otherwise the requested constraint alone."""
    requested, param = requested_constraint(req)
    if requested is not None:
        compile_or_400(compiler, requested, param)
    if plan is None or not plan.parse:
        return requested, param
    forced_or_joined = plan.forced is not None or (requested is not None and requested.kind in ("json", "json_object"))
    for i, tool in enumerate(plan.template_tools):
        parameters = tool["function"].get("parameters")
        if parameters is not None:
            try:
                compile_or_400(compiler, StructuredOutputsParams(json=parameters), f"tools.{i}.function.parameters")
            except APIError as e:      # tool_choice auto needs no grammar library: without one, no check either
                if forced_or_joined or e.code != "structured_outputs_unavailable":
                    raise
    functions = [t["function"] for t in plan.template_tools]
    if plan.forced is not None:
        if requested is not None:
            raise APIError(400, f"{param} cannot be combined with tool_choice {plan.forced!r}: the output is the "
                                "tool call", param=param)
        if plan.forced != "required":
            functions = [f for f in functions if f["name"] == plan.forced]
        parallel = plan.forced == "required" and req.parallel_tool_calls is not False
        grammar = tool_call_grammar(plan.format, functions, parallel, tokenizer)
    elif requested is not None and requested.kind in ("json", "json_object"):
        answer = {"type": "object"} if requested.kind == "json_object" else requested.json
        if isinstance(answer, str):
            answer = json.loads(answer)
        grammar = tool_call_grammar(plan.format, functions, req.parallel_tool_calls is not False, tokenizer, answer)
    else:
        return requested, param
    constraint = StructuredOutputsParams(grammar=grammar)
    compile_or_400(compiler, constraint, "tools")
    return constraint, "tools"
