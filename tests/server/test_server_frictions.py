"""What a new user met (issue 40): model retrieval, /version, stream_options without stream, vLLM's request metrics,
help texts that read right, one --gpu-memory-gb everywhere, and a human summary from `bench offline`."""
import json
from importlib.metadata import version

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import quant_serve.server.cli.main as cli
from conftest import QWEN_7B
from server_common import KEY, assert_error_shape, chat_messages, post, wait_until


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_retrieve_model_and_version(server, client):
    model = client.models.retrieve("tiny-alias")
    assert model.id == "tiny-alias" and model.model_extra["max_model_len"] == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("Qwen/Qwen2.5-7B")
    assert e.value.body["code"] == "model_not_found"
    assert httpx.get(server.url + "/version").json() == {"version": version("quant-serve")}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": chat_messages()})])
def test_stream_options_need_stream(server, path, body):
    for stream in ({}, {"stream": False}):
        error = assert_error_shape(post(server, path, {**body, **stream, "max_tokens": 2,
                                                       "stream_options": {"include_usage": True}}), 400)
        assert error["param"] == "stream_options", error


def _samples(server) -> dict[tuple, float]:
    """(name, finished_reason) -> value for every vllm: sample (histogram buckets left out)."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("vllm:") and "le" not in s.labels}


def test_request_metrics_under_vllm_names(server, client):
    first = client.completions.create(model="tiny", prompt="Once", max_tokens=1, temperature=0).choices[0].text
    first_id = post(server, "/tokenize", {"prompt": first, "add_special_tokens": False}).json()["tokens"]
    before = _samples(server)
    out = client.completions.create(model="tiny", prompt="The Python documentation", max_tokens=6, n=2,
                                    temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    stopped = client.completions.create(model="tiny", prompt="Once", max_tokens=4, temperature=0,
                                        extra_body={"stop_token_ids": first_id})
    after = _samples(server)

    def delta(name, reason=None):
        return after.get((name, reason), 0) - before.get((name, reason), 0)

    assert stopped.choices[0].finish_reason == "stop"
    assert delta("vllm:request_success_total", "length") == 2
    assert delta("vllm:request_success_total", "stop") == 1
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_prompt_tokens_sum") == 2 * out.usage.prompt_tokens + stopped.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 12 + stopped.usage.completion_tokens
    # one observation per token after a sequence's first, as inter_token_latency
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count") \
        == 2 * 5 + stopped.usage.completion_tokens - 1
    buckets = [s.labels["le"] for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
               for s in family.samples if s.name == "vllm:request_prompt_tokens_bucket"]
    assert buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]


def test_an_aborted_request_counts_as_abort(server):
    before = _samples(server)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        next(lines)
    assert wait_until(lambda: _samples(server).get(("vllm:request_success_total", "abort"), 0)
                      - before.get(("vllm:request_success_total", "abort"), 0) == 1, 10)


def _help_texts(parser) -> dict[str, str]:
    texts = {"": parser.format_help()}
    stack = [("", parser)]
    while stack:
        prefix, p = stack.pop()
        for action in p._actions:
            for name, child in getattr(action, "choices", None).items() if hasattr(action, "add_parser") else ():
                texts[f"{prefix} {name}".strip()] = child.format_help()
                stack.append((f"{prefix} {name}", child))
    return texts


def test_help_reads_right():
    texts = _help_texts(cli.build_parser())
    assert {"serve", "generate", "plan", "bench offline", "bench serve", "quantize", "eval"} <= set(texts)
    for command, text in texts.items():
        assert "(default: None)" not in " ".join(text.split()), command
    serve = " ".join(texts["serve"].split())
    assert "--async-scheduling, --no-async-scheduling" in serve and "(default: on)" in serve
    assert "(default: True)" not in serve and "(default: False)" not in serve
    parse = cli.build_parser().parse_args
    assert parse(["serve", "m"]).async_scheduling
    assert not parse(["serve", "m", "--no-async-scheduling"]).async_scheduling


def test_plan_takes_gpu_memory_gb_like_every_command():
    parse = cli.build_parser().parse_args
    assert parse(["plan", "m", "--gpu-memory-gb", "10"]).gpu_memory_gb == 10
    assert parse(["plan", "m", "--gpu-mem-gb", "12"]).gpu_memory_gb == 12       # the old name still works
    assert parse(["plan", "m"]).gpu_memory_gb is None          # 24 GiB, or the --gpu card's memory (below)
    assert "--gpu-mem-gb" not in _help_texts(cli.build_parser())["plan"]
    for command in (["serve", "m"], ["generate", "--prompt", "x"], ["bench", "offline"]):
        assert parse([*command, "--gpu-memory-gb", "24"]).gpu_memory_gb == 24


def test_plan_memory_defaults_to_24_gib_or_the_cards(capsys):
    qwen = str(QWEN_7B)
    for extra, gib in (([], 24), (["--gpu", "a100"], 80), (["--gpu", "a10", "--gpu-memory-gb", "20"], 20)):
        cli.main(["plan", qwen, "--kv-cache-dtype", "fp8", "--max-model-len", "4096", "--json", *extra])
        plan = json.loads(capsys.readouterr().out)
        assert plan["gpu_mem_bytes"] == gib * 2 ** 30, extra
        assert ("projection" in plan) == bool(extra)


def test_bench_offline_prints_a_summary_and_json(capsys, one_torch_thread, random_model):
    code = cli.main(["--log-level", "warning", "bench", "offline", "--model", str(random_model), "--device", "cpu",
                     "--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "128",
                     "--num-prompts", "2", "--input-len", "8", "--output-len", "4"])
    out, err = capsys.readouterr()
    assert code == 0
    result = json.loads(out)
    assert result["num_prompts"] == 2 and result["output_tok_s"] > 0
    for line in ("Offline Benchmark Result", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Median TTFT (ms):", "P99 TPOT (ms):"):
        assert line in err, err
    assert f"{result['requests_per_s']:.2f}" in err
