"""Issue 54: a structured-outputs constraint the grammar library cannot take is a 400 naming its parameter, one that
fails during generation ends its request with an error (422, or an SSE error event then [DONE]), never a 200
whose output breaks it; no KV block leaks, other requests go on, log lines name the failure, not the grammar.
Through the openai SDK against a real `quant-serve serve` on the bundled demo model, and the engine beneath it."""
import json
import threading

import openai
import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.sample.structured import GrammarCompiler, StructuredOutputsParams
from quant_serve.engine.sample.structured_limits import StructuredLimits, has_finite_instance

from server_common import KEY, running_server

OPTIONAL_PROPERTIES = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
RECURSIVE_REQUIRED = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
REF_SELF = {"$ref": "#"}
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# passes every check at request time (its first token is free, so the probe stops there), then the parser's row
# after "b" or "c" holds 9,000 alternatives, past llguidance's row limit: the grammar fails during generation
FAILS_LATE = 'start: ("b" | "c") pick\npick: ' + " | ".join(f'"x{i}"' for i in range(9000)) + "\n"
# the same failure on the first forced token: found when the grammar compiles
FAILS_FORCED = 'start: "q" pick\npick: ' + " | ".join(f'"x{i}"' for i in range(9000)) + "\n"


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# (endpoint, extra fields, the parameter the 400 names, a word of its message)
REFUSED = [
    ("completions", {"guided_choice": [f"c{i}" for i in range(10_000)]}, "guided_choice", "10000 items"),
    ("chat", {"response_format": _schema_format(OPTIONAL_PROPERTIES)}, "response_format", "10000 object properties"),
    ("completions", {"guided_json": RECURSIVE_REQUIRED}, "guided_json", "no finite instance"),
    ("completions", {"guided_regex": "a{1000000}"}, "guided_regex", "too many expressions"),
    ("chat", {"structured_outputs": {"json": REF_SELF}}, "structured_outputs", "no finite instance"),
    ("completions", {"response_format": _schema_format(REF_CYCLE)}, "response_format", "no finite instance"),
    ("completions", {"guided_grammar": FAILS_FORCED}, "guided_grammar", "row"),
    ("chat", {"tools": [_tool({"type": "object", "properties": {"v": {"enum": list(range(1001))}}})],
              "tool_choice": "required"}, "tools.0.function.parameters", "1001 enum values"),
]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The bundled demo model (no MODEL argument), its own process: its log is read here."""
    directory = tmp_path_factory.mktemp("structured-errors")
    (directory / "api-key").write_text(KEY + "\n")
    args = ["--num-gpu-blocks-override", "128", "--max-model-len", "256", "--max-num-seqs", "8", "--dtype",
            "float32", "--served-model-name", "demo", "--api-key-file", str(directory / "api-key")]
    with running_server(args, directory / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def sdk(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _create(sdk, endpoint: str, extra: dict, stream: bool, max_tokens: int = 8):
    """The request through the SDK; a stream is read to its end. -> the text it returned."""
    if endpoint == "chat":
        out = sdk.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Answer."}],
                                          max_tokens=max_tokens, temperature=0.0, stream=stream, extra_body=extra)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        return out.choices[0].message.content
    out = sdk.completions.create(model="demo", prompt="Answer:", max_tokens=max_tokens, temperature=0.0,
                                 stream=stream, extra_body=extra)
    return "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint, extra, param, words", REFUSED, ids=[r[2] + "-" + r[3] for r in REFUSED])
def test_what_the_grammar_library_cannot_take_is_a_400_naming_the_parameter(sdk, endpoint, extra, param, words,
                                                                            stream):
    with pytest.raises(openai.BadRequestError) as caught:
        _create(sdk, endpoint, extra, stream)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert len(error["message"]) < 1000, len(error["message"])          # the failure, not the grammar


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_grammar_that_fails_during_generation_is_a_422_never_a_200(sdk, demo_server, endpoint):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        _create(sdk, endpoint, {"guided_grammar": FAILS_LATE}, stream=False)
    error = caught.value.body
    assert error["param"] == "guided_grammar" and error["code"] == "structured_output_failed", error
    assert "row" in error["message"] and len(error["message"]) < 1000, error
    assert demo_server.pool_is_whole()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_grammar_that_fails_during_a_stream_ends_it_with_an_error_event(sdk, demo_server, endpoint):
    texts, finishes = [], []
    with pytest.raises(openai.APIError) as caught:
        if endpoint == "chat":
            stream = sdk.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Answer."}],
                                                 max_tokens=8, temperature=0.0, stream=True,
                                                 extra_body={"guided_grammar": FAILS_LATE})
            for chunk in stream:
                texts += [c.delta.content or "" for c in chunk.choices]
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
        else:
            stream = sdk.completions.create(model="demo", prompt="Answer:", max_tokens=8, temperature=0.0,
                                            stream=True, extra_body={"guided_grammar": FAILS_LATE})
            for chunk in stream:
                texts += [c.text for c in chunk.choices]
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert "structured_output_failed" in str(caught.value.body) or "failed during generation" in caught.value.message
    assert finishes == [] and "".join(texts) in ("", "b", "c")           # never a finished choice
    assert demo_server.pool_is_whole()


def test_the_stream_ends_with_done_after_the_error_event(demo_server):
    import httpx
    body = {"model": "demo", "prompt": "Answer:", "max_tokens": 8, "temperature": 0.0, "stream": True,
            "guided_grammar": FAILS_LATE}
    response = httpx.post(demo_server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200                                   # the stream had started
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "structured_output_failed" and error["param"] == "guided_grammar"
    assert all("finish_reason" not in e or json.loads(e)["choices"][0]["finish_reason"] is None
               for e in events[:-2])


def test_other_requests_go_on_and_the_log_names_the_failure_not_the_grammar(sdk, demo_server):
    """A failing request beside a normal one: the normal one gets its whole answer, the pool is whole after."""
    alone = _create(sdk, "completions", {"guided_choice": ["yes", "no"]}, stream=False)
    results = {}

    def failing():
        try:
            _create(sdk, "completions", {"guided_grammar": FAILS_LATE}, stream=False)
        except openai.UnprocessableEntityError as e:
            results["failed"] = e

    thread = threading.Thread(target=failing)
    thread.start()
    results["normal"] = _create(sdk, "completions", {"guided_choice": ["yes", "no"]}, stream=False)
    thread.join(120)
    assert "failed" in results and results["normal"] == alone
    assert demo_server.pool_is_whole()
    log = demo_server.log()
    lines = [line for line in log.splitlines() if "failed during generation" in line]
    assert lines and all(len(line) < 1000 for line in lines), lines
    assert '"x8999"' not in log and "x8999" not in log                   # no grammar in the log


def test_tool_call_arguments_python_cannot_read_are_a_400(sdk):
    def ask(arguments: str):
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return sdk.chat.completions.create(model="demo", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}])

    for arguments, words in (("1" * 5000, "integer string conversion"), ("[" * 990 + "]" * 990, "deep"),
                             ('{"a": ' * 990 + "1" + "}" * 990, "deep")):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(arguments)
        assert caught.value.body["param"] == "messages.1.tool_calls.0.function.arguments", caught.value.body
        assert words in caught.value.body["message"]
    assert ask('{"a": [1, 2]}').choices[0].finish_reason in ("stop", "length")


# ---- the engine beneath ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def test_a_compile_over_the_budget_is_refused_and_remembered(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                               StructuredLimits(compile_budget_s=0.001))
    compiler.tokenizer                                                   # built outside the budget
    schema = StructuredOutputsParams(json={"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(1000)}})
    with pytest.raises(ValueError, match="longer than the server's budget of 0.001 s"):
        compiler.compile(schema)
    with pytest.raises(ValueError, match="budget"):                      # at once, no second compilation
        compiler.compile(schema)
    compiler._executor.submit(lambda: None).result(timeout=60)           # the compilation ended by itself


def test_finite_instances():
    assert has_finite_instance({"type": "object", "properties": {"next": {"$ref": "#"}}})      # a linked list
    assert has_finite_instance({"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]})
    assert not has_finite_instance({"type": "array", "items": {"$ref": "#"}, "minItems": 1})
    assert not has_finite_instance({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]})
    assert not has_finite_instance(REF_CYCLE) and not has_finite_instance(REF_SELF)
    assert has_finite_instance({"$defs": {"t": {"type": ["object", "null"], "properties": {"c": {"$ref": "#/$defs/t"}},
                                                "required": ["c"]}}, "$ref": "#/$defs/t"})


def test_the_engine_ends_a_failed_grammar_with_an_error_and_frees_its_blocks():
    from helpers import assert_all_blocks_free, make_engine
    engine = make_engine(DEMO_MODEL_DIR, max_model_len=128)
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = engine.generate(["The sea"], free)[0].outputs[0].token_ids
    late = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"grammar": FAILS_LATE})
    failed, normal = engine.generate(["Answer:", "The sea"], [late, free])
    assert failed.outputs[0].finish_reason == "error" and "row" in failed.outputs[0].stop_reason
    assert failed.outputs[0].text in ("b", "c")              # its first token, free; the failing step's is dropped
    assert normal.outputs[0].token_ids == alone
    assert_all_blocks_free(engine)


def test_forced_tokens_are_counted_in_metrics(sdk, demo_server):
    before = demo_server.metrics().get("vllm:structured_output_forced_tokens_total", 0)
    flags = {"type": "object", "properties": {"visible": {"type": "boolean"}}, "required": ["visible"]}
    schema = {"type": "object", "properties": {"status": {"enum": ["active", "inactive"]}, "flags": flags},
              "required": ["status", "flags"]}
    text = _create(sdk, "chat", {"response_format": _schema_format(schema)}, stream=False, max_tokens=48)
    assert set(json.loads(text)) == {"status", "flags"}
    assert demo_server.metrics()["vllm:structured_output_forced_tokens_total"] > before
