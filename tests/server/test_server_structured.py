"""Structured outputs and tool calling through the real openai SDK against the shared server: parse() with a pydantic
model, response_format / vLLM's guided fields on completions, a two-turn tool conversation streamed and not,
tool_choice required / named honoured every time, and the 400s naming the parameter."""
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from server_common import assert_error_shape, chat_messages, post

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Definition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    word: str = Field(max_length=12)
    part_of_speech: Literal["noun", "verb", "adjective"]
    senses: int = Field(ge=1, le=9)


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model="tiny", messages=chat_messages("harbor"),
                                               response_format=Definition, max_tokens=64, temperature=1.0, seed=0, n=4)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Definition)
        assert json.loads(choice.message.content) == choice.message.parsed.model_dump()


def test_completions_follow_response_format_and_guided_fields(client):
    schema = Definition.model_json_schema()
    response_format = {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}
    out = client.completions.create(model="tiny", prompt="A definition as JSON:", max_tokens=64, temperature=0.8,
                                    seed=1, extra_body={"response_format": response_format})
    Definition.model_validate_json(out.choices[0].text)
    out = client.completions.create(model="tiny", prompt="Is it good?", max_tokens=8, temperature=1.0, seed=2, n=6,
                                    extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert {c.text for c in out.choices} <= {"yes", "no", "it depends"}
    out = client.completions.create(model="tiny", prompt="A date:", max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"structured_outputs": {"regex": "20[0-9]{2}-0[1-9]-[12][0-9]"}})
    assert out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].text) == 10 and out.choices[0].text.startswith("20")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
DEFINE = {"type": "function", "function": {
    "name": "define", "parameters": {"type": "object", "properties": {"word": {"enum": ["harbor", "lantern"]}},
                                     "required": ["word"]}}}
TOOLS = [WEATHER, DEFINE]


def _collect_stream(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_two_turn_tool_conversation_round_trips(client, shared_server, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=64, temperature=0.7, seed=4,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        content, calls, finish = _collect_stream(client.chat.completions.create(**first, stream=True))
    else:
        choice = client.chat.completions.create(**first).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
    assert not content and finish == "stop"           # a named function ends with "stop", as OpenAI answers it
    (call,) = calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    arguments = json.loads(call["arguments"])
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function",
                      "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 degrees"}]
    second = dict(model="tiny", messages=messages, tools=TOOLS, max_tokens=12, temperature=0.0)
    if stream:
        content, calls, finish = _collect_stream(client.chat.completions.create(**second, stream=True))
    else:
        answer = client.chat.completions.create(**second)
        content, calls, finish = answer.choices[0].message.content, answer.choices[0].message.tool_calls, \
            answer.choices[0].finish_reason
        # the tool's result went into the prompt: the same chat without it renders fewer tokens
        without = post(shared_server, CHAT, {**second, "messages": messages[:-1], "max_tokens": 1}).json()
        assert answer.usage.prompt_tokens > without["usage"]["prompt_tokens"]
    assert content and not calls and finish in ("stop", "length")


def _enum_tool(name: str, values: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}}}


SHORT_TOOLS = [_enum_tool("f", ["a", "b"]), _enum_tool("g", ["c", "d"])]     # short calls: the test stays fast


def test_tool_choice_required_and_named_are_honoured_100_times_out_of_100(client):
    """100 choices each way (10 requests of n = 10, all in flight together), sampled at temperature 1: every one is
    a single call of an allowed function with arguments that follow its schema."""
    named = {"type": "function", "function": {"name": "g"}}

    def ask(job):
        tool_choice, seed = job
        return tool_choice, client.chat.completions.create(
            model="tiny", messages=chat_messages("harbor"), tools=SHORT_TOOLS, tool_choice=tool_choice, n=10,
            seed=seed, temperature=1.0, max_tokens=48, parallel_tool_calls=False).choices

    jobs = [(choice, seed) for seed in range(10) for choice in ("required", named)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for mode, allowed, finish in (("required", {"f": {"a", "b"}, "g": {"c", "d"}}, "tool_calls"),
                                  (named, {"g": {"c", "d"}}, "stop")):
        choices = [c for tool_choice, cs in answers if tool_choice == mode for c in cs]
        assert len(choices) == 100
        for choice in choices:
            (call,) = choice.message.tool_calls
            assert not choice.message.content and choice.finish_reason == finish
            arguments = json.loads(call.function.arguments)
            assert set(arguments) == {"v"} and arguments["v"] in allowed[call.function.name], call
    assert {c.message.tool_calls[0].function.name for _, cs in answers for c in cs} == {"f", "g"}


@pytest.mark.parametrize("path, extra, param", [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
            "tool_choice": "auto"}, "tools.0.function.parameters"),
    (CHAT, {"tools": [WEATHER, WEATHER]}, "tools"),
    (CHAT, {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    (COMPLETIONS, {"guided_regex": "a(b"}, "guided_regex"),
    (COMPLETIONS, {"guided_grammar": "start: nope"}, "guided_grammar"),
    (COMPLETIONS, {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_parameter(shared_server, path, extra, param):
    body = {"messages": chat_messages(), "max_tokens": 2} if path == CHAT else {"prompt": "hello", "max_tokens": 2}
    error = assert_error_shape(post(shared_server, path, {**body, **extra}), 400)
    assert error["param"] == param, error
    assert shared_server.health()["status"] == "ok"
