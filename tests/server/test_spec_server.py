"""Speculative decoding through the OpenAI API: the --speculative-config flag, greedy text equal to the plain engine,
and vLLM's spec-decode counters in /metrics."""
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.server.cli.engine_args import ArgumentParser, add_engine_args, speculative_config_from_args

from helpers import bench_script, make_engine
from server_common import running_server

PROMPT = "Copy this exactly: list.append(x): Add an item to the end of the list.\nCopy: list.append(x): Add an item"


def test_speculative_flags_like_vllm():
    p = ArgumentParser()
    add_engine_args(p)
    cfg = speculative_config_from_args(p.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}',
         "--speculative-disable-batch-size", "2"]))
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.disable_by_batch_size) == \
        ("ngram", 3, 5, 2)
    cfg = speculative_config_from_args(p.parse_args(["--speculative-model", "/m", "--num-speculative-tokens", "2"]))
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m", 2)
    assert not speculative_config_from_args(p.parse_args([])).enabled
    for bad in (['--speculative-config', '{"method": "eagle", "num_speculative_tokens": 2}'],
                ['--speculative-config', '{"num_speculative_tokens": 2, "typo": 1}'],
                ['--speculative-config', 'nope'], ['--speculative-model', 'ngram']):
        try:
            speculative_config_from_args(p.parse_args(bad))
        except SystemExit as e:
            assert str(e).startswith("error:"), e
        else:
            raise AssertionError(f"accepted {bad}")


def _draft(tmp_path, trained_model):
    return bench_script("spec_decode").truncated_model(trained_model, 2, tmp_path / "tiny-2-layers")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_through_the_openai_api(method, tmp_path, trained_model):
    engine = make_engine(trained_model, max_model_len=512)
    expected = engine.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))
    if method == "ngram":
        spec = ["--speculative-config", json.dumps(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})]
    else:
        spec = ["--speculative-model", str(_draft(tmp_path, trained_model)), "--num-speculative-tokens", "3"]
    args = [str(trained_model), "--num-gpu-blocks-override", "64", "--max-model-len", "512", "--dtype", "float32",
            "--served-model-name", "tiny", *spec]
    with running_server(args, tmp_path / "server.log") as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[0].outputs[0].text
        samples = {}
        for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
            for s in family.samples:
                if s.name.startswith("vllm:spec_decode"):
                    samples[(s.name, s.labels.get("position"))] = s.value
        drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
        proposed = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
        accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
        per_pos = [v for (name, pos), v in sorted(samples.items(), key=lambda kv: str(kv[0]))
                   if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
        assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
        assert sum(per_pos) == accepted
        assert server.pool_is_whole()
