"""Tool-call formats (hermes / Qwen, Llama 3.1 JSON, Mistral) parsed into OpenAI tool calls, whole and streamed (the
deltas add up to the same calls, however the text is cut), the grammars that force them, and the chat template
round trip of tools, assistant tool calls and tool results."""
import json

import pytest
from transformers import AutoTokenizer

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sample.structured import GrammarCompiler, StructuredOutputsParams, close_objects
from quant_serve.server.chat_template import ChatEncoder
from quant_serve.server.protocol import ChatMessage
from quant_serve.server.tool_grammar import tool_call_grammar
from quant_serve.server.tool_parsers import (HERMES, LLAMA3_JSON, MISTRAL, ToolCallStream, detect_format,
                                             extract_tool_calls)

WEATHER = '{"city": "Paris", "days": [1, 2], "opts": {"unit": "c"}}'
CASES = [
    (HERMES, f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "define", "arguments": {"word": "a \\"b\\" }"}}\n</tool_call>',
     "Let me look.", [("get_weather", WEATHER), ("define", '{"word": "a \\"b\\" }"}')]),
    (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "define", "parameters": {{}}}}',
     None, [("get_weather", WEATHER), ("define", "{}")]),
    (MISTRAL, f'[{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "define", "arguments": {{"w": 1}}}}]',
     None, [("get_weather", WEATHER), ("define", '{"w": 1}')]),
    (MISTRAL, f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', "Sure.",
     [("get_weather", WEATHER)]),
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_output_parses_into_calls(fmt, text, content, calls):
    got_content, got = extract_tool_calls(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


def _stream(fmt, text: str, cut: int) -> tuple[str, list[dict], list[dict]]:
    parser, content, deltas = ToolCallStream(fmt), "", []
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for i, piece in enumerate(pieces):
        c, d = parser.feed(piece, final=i == len(pieces) - 1)
        content += c
        deltas += d
    calls: dict[int, dict] = {}
    for d in deltas:                       # how a client (the openai SDK) assembles them
        call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        if "id" in d:
            assert call["name"] == "" and d["function"]["arguments"] == "" and d["type"] == "function"
            call["id"] = d["id"]
        call["name"] += d["function"].get("name", "")
        call["arguments"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_same_calls(fmt, text, content, calls, cut):
    got_content, got, deltas = _stream(fmt, text, cut)
    assert got_content.strip() == (content or "")
    assert [(c["name"], c["arguments"]) for c in got] == calls
    assert all("id" in c for c in got)
    # arguments stream as they are written, not in one piece at the end
    assert cut > 100 or sum(bool(d["function"]["arguments"]) for d in deltas) > len(calls)


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "No tools needed: the answer is 4."),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": '),                  # cut off: content, not a call
    (LLAMA3_JSON, '{"answer": 4}'),                                             # JSON that is not a call
    (MISTRAL, "[1, 2, 3] are numbers"),
])
def test_output_without_a_complete_call_is_content(fmt, text):
    assert extract_tool_calls(text, fmt) == (text, [])
    if fmt is not HERMES or "<tool_call>" not in text:       # a cut-off call streams its beginning as a call
        content, calls, _ = _stream(fmt, text, 2)
        assert (content, calls) == (text, [])


def test_format_is_detected_from_the_template():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("<|start_header_id|>ipython<|end_header_id|> {{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert detect_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_format(None) is HERMES


FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
                 "city": {"type": "string", "maxLength": 8}, "unit": {"$ref": "#/$defs/Unit"}},
                 "required": ["city", "unit"], "$defs": {"Unit": {"enum": ["c", "f"]}}}},
             {"name": "noop"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_forced_call_grammar_accepts_the_format_and_refuses_other_calls(fmt, tokenizer):
    import llguidance
    compiler = GrammarCompiler(tokenizer, 8192, (2,))
    grammar = compiler.compile(StructuredOutputsParams(grammar=tool_call_grammar(fmt, FUNCTIONS, True, tokenizer)))

    def accepts(calls: list[tuple[str, dict]]) -> bool:
        body = fmt.call_separator.join(
            fmt.call_open + json.dumps({"name": n, fmt.arguments_key: a}) + fmt.call_close for n, a in calls)
        text = fmt.grammar_marker + fmt.list_open + body + fmt.list_close
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    good = ("get_weather", {"city": "Paris", "unit": "c"})
    assert accepts([good]) and accepts([good, ("noop", {})])
    assert not accepts([("get_time", {})])                                  # an unknown function
    assert not accepts([("get_weather", {"city": "Paris", "unit": "k"})])  # arguments off the schema
    assert not accepts([("get_weather", {"city": "Paris", "unit": "c", "extra": 1})])   # closed objects
    assert extract_tool_calls(fmt.grammar_marker + fmt.list_open + fmt.call_open +
                              json.dumps({"name": "noop", fmt.arguments_key: {}}) + fmt.call_close + fmt.list_close,
                              fmt)[1][0]["function"]["name"] == "noop"


def test_close_objects_closes_schemas_not_property_names():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}}},
              "$defs": {"X": {"properties": {"b": {}}}}, "allOf": [{"properties": {"c": {}}}],
              "items": {"properties": {"d": {}}, "additionalProperties": True}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]          # the name map is not a schema
    assert closed["$defs"]["X"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["items"]["additionalProperties"] is True
    assert "additionalProperties" not in schema                         # the caller's schema is untouched


QWEN_LIKE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_renders_tools_calls_and_results(tokenizer):
    encoder = ChatEncoder(tokenizer)
    tokenizer = encoder.tokenizer
    original, tokenizer.chat_template = tokenizer.chat_template, QWEN_LIKE_TEMPLATE
    try:
        messages = [ChatMessage(role="user", content="Weather in Paris?"),
                    ChatMessage(role="assistant", content=None, tool_calls=[
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
                    ChatMessage(role="tool", content="sunny, 21 C", tool_call_id="call_1")]
        tools = [{"type": "function", "function": FUNCTIONS[0]}]
        text = tokenizer.decode(encoder.encode(messages, tools=tools))
    finally:
        tokenizer.chat_template = original
    assert '"name": "get_weather"' in text.split("</tools>")[0]                # the tools
    # the call's arguments as the object (not a quoted JSON string), then the result
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
