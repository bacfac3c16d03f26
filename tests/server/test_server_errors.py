"""Failure paths: a full waiting queue (503), an engine failure of one request (500, the server lives on), a step
that fails, and `serve` without a model."""
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

import quant_serve.server.cli.main
import quant_serve.server.cli.engine_args
from helpers import assert_all_blocks_free, make_engine
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.server.app import build_app
from quant_serve.server.cli.serve import startup_report
from server_common import assert_error_shape, running_server, wait_until

LONG = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def queue_server(tmp_path_factory, trained_model):
    args = [str(trained_model), "--num-gpu-blocks-override", "64", "--max-model-len", "256", "--max-num-seqs", "1",
            "--max-queued-requests", "2", "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("queue") / "server.log") as s:
        yield s


def test_full_waiting_queue_is_503_with_retry_after(queue_server):
    """The cap counts sequences (2 here): a request of two prompts fills it."""
    url = queue_server.url + "/v1/completions"
    with httpx.Client(timeout=60) as http:
        too_many = http.post(url, json={**LONG, "prompt": ["a", "b", "c"]})     # more than the cap: never fits
        assert assert_error_shape(too_many, 400)["param"] == "prompt"
        with http.stream("POST", url, json={**LONG, "stream": True}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()     # keep a reference: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")
            assert wait_until(lambda: queue_server.health()["num_requests_running"] == 1, 10)
            two = {**LONG, "prompt": [LONG["prompt"], "Twice upon a time"], "stream": True}
            with http.stream("POST", url, json=two) as waiting:
                assert waiting.status_code == 200
                assert wait_until(lambda: queue_server.health()["num_requests_waiting"] == 2, 10)
                for stream in (False, True):    # a stream is refused before it starts, not with 200 + error event
                    refused = http.post(url, json={**LONG, "stream": stream})
                    error = assert_error_shape(refused, 503, "queue_full")
                    assert refused.headers["retry-after"] == "1" and error["type"] == "server_error"
                assert queue_server.health()["num_requests_waiting"] == 2
    assert wait_until(queue_server.pool_is_whole, 10), queue_server.health()
    again = httpx.post(url, json={**LONG, "max_tokens": 2}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def engine(one_torch_thread, trained_model):
    return make_engine(trained_model, num_blocks=64, max_model_len=256, max_num_seqs=8)


def _completion(client, prompt: str, max_tokens: int, **kw):
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                                                "temperature": 0, **kw})


def test_failure_in_one_requests_output_is_500_and_spares_the_others(engine, monkeypatch, caplog):
    bad_prompt = engine.tokenizer.encode("BOOM goes this request")
    real_step = engine.step

    class Exploding:
        def __bool__(self):
            raise RuntimeError("boom while processing this output")

    def step():
        outputs = real_step()
        for out in outputs:
            if out.prompt_token_ids == bad_prompt and len(out.outputs[0].token_ids) == 3:   # mid-generation
                out.finished = Exploding()
        return outputs

    monkeypatch.setattr(engine, "step", step)
    with TestClient(build_app(engine, ["tiny"]), raise_server_exceptions=False) as client:
        with ThreadPoolExecutor(2) as pool:
            good = pool.submit(_completion, client, "Once upon a time", 60)
            started = wait_until(lambda: client.get("/health").json()["num_requests_running"] == 1, 10)
            bad = pool.submit(_completion, client, "BOOM goes this request", 60)
            bad, good = bad.result(), good.result()
        assert started
        error = assert_error_shape(bad, 500, "internal_error")
        assert "boom" not in error["message"], "a 5xx never echoes the exception"
        error_id = error["message"].split("error id ")[1].split(";")[0]
        assert any(error_id in r.getMessage() and "boom while processing this output" in r.getMessage()
                   for r in caplog.records), "the log has the details under the id"
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 60

        streamed = _completion(client, "BOOM goes this request", 60, stream=True)
        assert streamed.status_code == 200
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert '"internal_error"' in events[-2] and "boom" not in events[-2] and events[-1] == "[DONE]"

        assert _completion(client, "Once upon a time", 5).status_code == 200
        assert client.get("/health").status_code == 200
    assert_all_blocks_free(engine)


def test_failed_step_fails_the_requests_in_flight_and_the_server_lives_on(engine, monkeypatch):
    calls = {"n": 0}
    lock = threading.Lock()

    real_launch = engine.runner.launch

    def launch(*args):
        with lock:
            calls["n"] += 1
            if calls["n"] == 4:         # a few tokens in: blocks are allocated
                raise RuntimeError("kernel exploded")
        return real_launch(*args)

    monkeypatch.setattr(engine.runner, "launch", launch)
    with TestClient(build_app(engine, ["tiny"]), raise_server_exceptions=False) as client:
        error = assert_error_shape(_completion(client, "Once upon a time", 20), 500, "internal_error")
        assert "kernel exploded" not in error["message"] and "error id err-" in error["message"]
        after = _completion(client, "Once upon a time", 5)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
    assert_all_blocks_free(engine)


def test_serve_takes_vllm_flag_names():
    args = quant_serve.server.cli.main.build_parser().parse_args([
        "serve", "some/model", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "a", "b",
        "--api-key", "k", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8", "--no-enable-prefix-caching",
        "--enforce-eager", "--quantization", "awq", "--dtype", "float16", "--max-queued-requests", "7",
        "--load-format", "safetensors"])
    config = quant_serve.server.cli.main.engine_config_from_args(args)
    assert (args.host, args.port, args.served_model_name, args.api_key, args.max_queued_requests) == \
        ("0.0.0.0", 9000, ["a", "b"], "k", 7)
    assert config.model == "some/model" and config.max_model_len == 128 and config.enforce_eager
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (4, 256)
    assert (config.cache.gpu_memory_utilization, config.cache.kv_cache_dtype) == (0.5, "fp8")
    assert not config.cache.enable_prefix_caching
    assert (config.quantization, config.dtype, config.load_format) == ("awq", "float16", "safetensors")


def test_token_budget_defaults_follow_vllm():
    """Serving keeps 2048-token steps (inter-token latency); offline commands take 8192 (throughput)."""
    parse = quant_serve.server.cli.main.build_parser().parse_args
    config = quant_serve.server.cli.main.engine_config_from_args
    budget = lambda argv: config(parse(argv)).scheduler.max_num_batched_tokens  # noqa: E731
    assert budget(["serve", "m"]) == 2048
    assert budget(["bench", "offline", "--model", "m"]) == 8192
    assert budget(["generate", "--model", "m", "--prompt", "hi"]) == 8192
    assert budget(["bench", "offline", "--model", "m", "--max-num-batched-tokens", "512"]) == 512


def test_serve_without_a_model_fails_clearly(monkeypatch, capsys):
    monkeypatch.setattr(quant_serve.server.cli.engine_args, "demo_model_dir", lambda: None)
    assert quant_serve.server.cli.main.main(["serve", "--port", "1"]) == 2
    assert "no MODEL given and the bundled demo model is not installed" in capsys.readouterr().err


def test_startup_report_names_the_quantization(one_torch_thread):
    engine = make_engine(DEMO_MODEL_DIR, num_blocks=64, max_model_len=256, dtype="auto")      # our AWQ g128
    loaded, memory, kv = startup_report(engine)
    assert "awq" in loaded and "4-bit" in loaded and "group 128" in loaded
    assert "weights" in memory and "KV cache 8.0 MiB" in memory
    assert kv == "KV cache: 1024 tokens, max concurrency 4.0 at 256 tokens"
