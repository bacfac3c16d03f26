"""Error statuses, tokenizer endpoints, client disconnects and /metrics, against the shared real server."""
import json
import os
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server_common import KEY, assert_error_shape, chat_messages, post, wait_until


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def tokenizer(trained_model):
    return AutoTokenizer.from_pretrained(trained_model)


def test_api_key(server):
    assert_error_shape(httpx.get(server.url + "/v1/models"), 401, "invalid_api_key")
    assert_error_shape(post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401, "invalid_api_key")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    # open, as in vLLM
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url + path).status_code == 200
    # the tokenizer endpoints need the key too (a large unauthenticated /tokenize used to cost everyone)
    assert_error_shape(httpx.get(server.url + "/tokenizer_info"), 401, "invalid_api_key")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert_error_shape(post(server, path, body, key=None), 401, "invalid_api_key")
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert_error_shape(post(server, "/v1/chat/completions", {"model": "nope", "messages": chat_messages()}), 404,
                       "model_not_found")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": "abc"}, "n"),                       # pydantic, not FastAPI's 422
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),        # 0 only with echo
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),                         # more than --max-num-seqs
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": chat_messages(), "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": chat_messages(), "presence_penalty": 3}, "presence_penalty"),
])
def test_invalid_parameters_are_400(server, path, body, param):
    error = assert_error_shape(post(server, path, body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_malformed_json_is_400(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{bad json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert_error_shape(response, 400)
    assert_error_shape(httpx.get(server.url + "/no/such/route"), 404)


def test_context_length_exceeded(server, client):
    long_prompt = "word " * 600
    error = assert_error_shape(post(server, "/v1/completions", {"prompt": long_prompt}), 400,
                               "context_length_exceeded")
    assert "512" in error["message"]
    too_many = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 511})
    assert_error_shape(too_many, 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}])
    assert e.value.code == "context_length_exceeded"
    assert server.pool_is_whole()


def test_tokenizer_endpoints(server, tokenizer):
    text = "The Python documentation is good."
    body = post(server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 512
    chat = post(server, "/tokenize", {"messages": chat_messages()}).json()["tokens"]
    rendered = tokenizer.apply_chat_template(chat_messages(), tokenize=False, add_generation_prompt=True)
    assert chat == tokenizer.encode(rendered, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == text
    assert_error_shape(post(server, "/detokenize", {"tokens": [1, -5]}), 400)
    assert_error_shape(post(server, "/tokenize", {"prompt": "x", "model": "nope"}), 404, "model_not_found")
    info = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    assert info["tokenizer_class"] == type(tokenizer).__name__


def _generated_since(server, before: dict) -> float:
    return server.metrics()["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = server.metrics()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        data = [line for line in (next(lines) for _ in range(12)) if line.startswith("data: ")]
        assert json.loads(data[0][6:])["choices"][0]["text"] is not None
        busy = server.health()
        assert busy["num_requests_running"] == 1 and busy["kv_cache_usage"] > 0
    assert wait_until(server.pool_is_whole, timeout=10), server.health()
    metrics = server.metrics()
    assert metrics["vllm:kv_cache_usage_perc"] == 0 and metrics["vllm:num_requests_running"] == 0
    assert _generated_since(server, before) < 400, "the request ran on after its client left"


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    before = server.metrics()
    body = {"model": "tiny", "messages": chat_messages(), "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/chat/completions", body, timeout=1.0)
    assert wait_until(server.pool_is_whole, timeout=10), server.health()
    assert _generated_since(server, before) < 400


def test_metrics_move_with_traffic(server, client):
    before = server.metrics()
    resp = client.completions.create(model="tiny", prompt="The Python documentation", max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name):
        return after[name] - before[name]

    assert delta("vllm:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 10
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"vllm:{name}_seconds_count") == 1, name
    assert delta("vllm:inter_token_latency_seconds_count") == 9
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert "vllm:num_preemptions_total" in after

    text = httpx.get(server.url + "/metrics").text
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"}' in text

    # the same long prompt twice: the second one is served from the prefix cache
    prompt = "The Python documentation describes the standard library in great detail. " * 5
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    before = server.metrics()
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = server.metrics()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert cached == (second.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:prefix_cache_queries_total") == second.usage.prompt_tokens


def test_sse_framing(server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}      # ignore_eos: a sampled EOS would end it early
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
    assert all(p["object"] == "text_completion" and p["id"] == payloads[0]["id"] for p in payloads)


def test_idle_engine_loop_does_not_spin(server):
    """With no requests the engine thread sleeps on an event: the process uses (almost) no CPU."""
    stat = f"/proc/{server.proc.pid}/stat"
    try:
        open(stat).close()
    except OSError:
        pytest.skip("needs /proc")
    assert wait_until(server.pool_is_whole, 10)

    def cpu_seconds() -> float:
        fields = open(stat).read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime

    before = cpu_seconds()
    time.sleep(1.5)
    assert cpu_seconds() - before < 0.2
