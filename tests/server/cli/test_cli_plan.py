"""`quant-serve plan` on the real Qwen2.5-7B / Llama-3.1-8B configs (config.json only, no weights)."""
import json

from quant_serve.server.cli.main import main

from conftest import LLAMA_8B as LLAMA, QWEN_7B as QWEN


def _plan(capsys, *args):
    code = main(["plan", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_plan_json_qwen_awq_fp8(capsys):
    code, plan = _plan(capsys, QWEN, "--kv-cache-dtype", "fp8", "--max-model-len", "32768")
    assert code == 0
    assert plan["kv_bytes_per_token"] == 28 * 1024                    # targets.md: 28 KiB per token in fp8
    assert plan["kv_cache_tokens"] >= 500_000                          # targets.md capacity goal on 24 GiB
    assert plan["max_concurrency"] == plan["kv_cache_tokens"] / 32768
    assert 5.0e9 < plan["weights_bytes"] < 6.0e9                       # INT4 g128 + fp16 embed and head


def test_plan_json_llama_gptq_fp16(capsys):
    code, plan = _plan(capsys, LLAMA, "--max-model-len", "8192")
    assert code == 0
    assert plan["kv_bytes_per_token"] == 128 * 1024                   # targets.md: 128 KiB per token in fp16
    assert plan["max_model_len_fit"] >= 8192


def test_plan_exact_weights_from_headers(capsys, random_model):
    code, plan = _plan(capsys, random_model)
    total = sum(p.stat().st_size for p in random_model.glob("*.safetensors"))
    assert code == 0 and plan["weights_source"] == "safetensors"
    assert 0 < total - plan["weights_bytes"] < 64 * 1024                # file sizes = tensors + small headers


def test_plan_too_small_card_fails_with_largest_context(capsys):
    code = main(["plan", str(LLAMA), "--gpu-mem-gb", "10", "--max-model-len", "131072"])
    captured = capsys.readouterr()
    assert code == 1
    assert "largest context that fits" in captured.out
    assert "12,080" in captured.out or "12080" in captured.err + captured.out
