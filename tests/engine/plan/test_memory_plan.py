"""Memory plan: KV arithmetic, exact weight bytes, block budget, and the fit / no-fit boundary."""
import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from quant_serve.engine.plan.memory import format_plan, kv_dtype_bytes, plan_memory

from conftest import LLAMA_8B as LLAMA, QWEN_7B as QWEN


def _cfg(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _int4_tensors(fmt: str, k: int, n: int, g: int = 128) -> dict:
    """Tensor shapes and item sizes of one INT4 Linear as listed in docs/formats.md."""
    groups = math.ceil(k / g)
    if fmt == "awq":
        return {"qweight": ([k, n // 8], 4), "qzeros": ([groups, n // 8], 4), "scales": ([groups, n], 2)}
    return {"qweight": ([k // 8, n], 4), "qzeros": ([groups, n // 8], 4), "scales": ([groups, n], 2),
            "g_idx": ([k], 4)}


def _checkpoint_bytes(cfg: dict, fmt: str, qkv_bias: bool) -> int:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    qd, kvd = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    tensors = {"model.embed_tokens.weight": ([v, h], 2), "model.norm.weight": ([h], 2)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = ([v, h], 2)
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}."
        tensors[pre + "input_layernorm.weight"] = ([h], 2)
        tensors[pre + "post_attention_layernorm.weight"] = ([h], 2)
        linears = {"self_attn.q_proj": (h, qd), "self_attn.k_proj": (h, kvd), "self_attn.v_proj": (h, kvd),
                   "self_attn.o_proj": (qd, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i),
                   "mlp.down_proj": (i, h)}
        for name, (k, n) in linears.items():
            for t, spec in _int4_tensors(fmt, k, n).items():
                tensors[f"{pre}{name}.{t}"] = spec
            if qkv_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{pre}{name}.bias"] = ([n], 2)
    return sum(math.prod(shape) * size for shape, size in tensors.values())


def _header_bytes(model_dir: Path) -> int:
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                total += math.prod(s.get_shape()) * {"F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}[s.get_dtype()]
    return total


def test_kv_bytes_per_token():
    assert plan_memory(QWEN, kv_cache_dtype="auto").kv_bytes_per_token == 57344 == 56 * 1024
    assert plan_memory(QWEN, kv_cache_dtype="fp8").kv_bytes_per_token == 28672
    assert plan_memory(LLAMA, kv_cache_dtype="bf16").kv_bytes_per_token == 131072
    assert plan_memory(LLAMA, kv_cache_dtype="fp8_e5m2").kv_bytes_per_token == 65536


def test_kv_dtype_bytes():
    assert kv_dtype_bytes("auto", "bfloat16") == 2
    assert kv_dtype_bytes("auto", "float32") == 4
    assert kv_dtype_bytes("fp16", "float32") == 2
    assert kv_dtype_bytes("fp8_e4m3", "float16") == 1
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_dtype_bytes("int8", "float16")


def test_qwen_awq_weights_match_per_tensor_sum():
    plan = plan_memory(QWEN)
    assert plan.weights_source == "config"
    assert plan.weights_bytes == _checkpoint_bytes(_cfg(QWEN), "awq", qkv_bias=True)
    per_step = plan.weights_bytes - 152064 * 3584 * 2  # the embedding is stored but not read per decode step
    assert 4.4e9 < per_step < 4.6e9                    # targets.md: about 4.5 GB (4.48) per decode step
    assert 5.4e9 < plan.weights_bytes < 5.6e9


def test_llama_gptq_weights_match_per_tensor_sum():
    plan = plan_memory(LLAMA)
    assert plan.weights_bytes == _checkpoint_bytes(_cfg(LLAMA), "gptq", qkv_bias=False)
    assert 4.6e9 < plan.weights_bytes - 128256 * 4096 * 2 < 4.8e9  # targets.md: 4.7 GB per step


@pytest.mark.parametrize("fixture", ["random_model", "random_awq", "random_ct", "tiny_awq_autoawq", "tiny_ct"])
def test_tiny_weights_exact_from_headers_and_from_config(fixture, request):
    """FP16 and our AWQ and compressed-tensors writers' checkpoints, and AutoAWQ's and llm-compressor's."""
    model_dir = request.getfixturevalue(fixture)
    expected = _header_bytes(model_dir)
    plan = plan_memory(model_dir)
    assert plan.weights_source == "safetensors"
    assert plan.weights_bytes == expected
    # The config-only formula must land on the same byte count as the real checkpoint.
    assert plan_memory(_cfg(model_dir)).weights_bytes == expected


def test_weights_dtype_override_rescales_float_tensors(random_model):
    assert plan_memory(random_model, weights_dtype="float32").weights_bytes == 2 * _header_bytes(
        random_model)  # every tensor there is F16


def test_qwen_fp8_capacity_goal_and_block_budget():
    plan = plan_memory(QWEN, gpu_mem_gb=24, kv_cache_dtype="fp8", max_model_len=32768)
    assert plan.usable_bytes == int(24 * 2**30 * 0.90)
    assert plan.kv_cache_tokens >= 500_000  # targets.md capacity goal
    assert plan.kv_cache_tokens == plan.num_blocks * 16
    assert plan.kv_cache_bytes == plan.kv_cache_tokens * 28672
    left = (plan.usable_bytes - plan.weights_bytes - plan.activation_bytes - plan.cuda_graph_bytes
            - plan.overhead_bytes - plan.kv_cache_bytes)
    assert 0 <= left < 16 * 28672  # the whole remainder goes to KV, to within one block
    assert plan.max_concurrency == pytest.approx(plan.kv_cache_tokens / 32768)
    assert plan.fits and plan.max_model_len_fit == 32768 and plan.error_message() == ""
    fp16 = plan_memory(QWEN, gpu_mem_gb=24, kv_cache_dtype="auto", max_model_len=32768)
    assert fp16.num_blocks == pytest.approx(plan.num_blocks / 2, abs=1)


def test_reserves_scale_with_settings():
    base = plan_memory(QWEN, kv_cache_dtype="fp8")
    eager = plan_memory(QWEN, kv_cache_dtype="fp8", enforce_eager=True)
    assert base.cuda_graph_bytes > 0 and eager.cuda_graph_bytes == 0
    assert eager.num_blocks > base.num_blocks
    bigger = plan_memory(QWEN, kv_cache_dtype="fp8", max_num_batched_tokens=8192)
    assert bigger.activation_bytes > base.activation_bytes and bigger.num_blocks < base.num_blocks
    fewer_rows = plan_memory(QWEN, kv_cache_dtype="fp8", max_num_seqs=16)
    assert fewer_rows.activation_bytes < base.activation_bytes


def test_too_small_gpu_does_not_fit_and_names_largest_context():
    nothing = plan_memory(LLAMA, gpu_mem_gb=6, max_model_len=131072)
    assert not nothing.fits and nothing.max_model_len_fit == 0 and nothing.num_blocks == 0
    assert "largest context that fits: 0" in nothing.error_message()

    plan = plan_memory(LLAMA, gpu_mem_gb=10, max_model_len=131072)
    fit = plan.max_model_len_fit
    assert not plan.fits and 0 < fit < 131072 and fit % 16 == 0
    assert str(fit) in plan.error_message() and "DOES NOT FIT" in format_plan(plan)
    assert plan_memory(LLAMA, gpu_mem_gb=10, max_model_len=fit).fits
    assert not plan_memory(LLAMA, gpu_mem_gb=10, max_model_len=fit + 16).fits


def test_max_model_len_fit_monotonic_and_capped():
    fits = [plan_memory(LLAMA, gpu_mem_gb=gb, kv_cache_dtype="fp8", max_model_len=8192).max_model_len_fit
            for gb in (4, 6, 8, 10, 12, 16, 24, 40, 80)]
    assert fits == sorted(fits) and fits[0] == 0 and fits[3] > 0
    assert fits[-1] == 131072  # capped at max_position_embeddings


def test_config_styles_and_defaults():
    cfg = _cfg(QWEN)
    cfg.pop("quantization_config")
    bf16 = plan_memory(cfg)
    assert bf16.max_model_len == 32768
    assert bf16.weights_bytes == 2 * 7615616512  # Qwen2.5-7B's published parameter count, in bf16
    # No head_dim, no num_key_value_heads: head_dim = hidden / heads, kv_heads = heads.
    mha = {k: v for k, v in cfg.items() if k != "num_key_value_heads"}
    assert plan_memory(mha).kv_bytes_per_token == 2 * 28 * 28 * 128 * 2
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    old_style = dict(cfg, rope_scaling=yarn)
    new_style = dict(cfg, rope_parameters=dict(yarn, rope_type="yarn", rope_theta=1e6))
    assert plan_memory(old_style).max_position_embeddings == 131072
    assert plan_memory(new_style).max_position_embeddings == 131072
    # The stretched window is original x factor (vLLM's rule), not max_position_embeddings x factor.
    shorter = dict(cfg, rope_scaling=dict(yarn, original_max_position_embeddings=16384))
    assert plan_memory(shorter).max_position_embeddings == 65536
    assert plan_memory(dict(cfg, rope_scaling={"type": "linear", "factor": 2.0})).max_position_embeddings == 65536
    assert plan_memory(LLAMA).max_position_embeddings == 131072  # llama3 rope: already the extended window
    with pytest.raises(ValueError, match="max_model_len"):
        plan_memory(cfg, max_model_len=65536)


def test_format_and_dict():
    plan = plan_memory(QWEN, kv_cache_dtype="fp8", max_model_len=32768)
    text = format_plan(plan)
    assert (f"KV cache: {plan.num_blocks:,} blocks = {plan.kv_cache_tokens:,} tokens, "
            f"max concurrency {plan.max_concurrency:.2f} at max_model_len 32,768") in text
    assert f"{plan.weights_bytes / 2**30:.2f} GiB" in text
    d = json.loads(json.dumps(plan.to_dict()))
    for key in ("weights_bytes", "kv_bytes_per_token", "kv_cache_tokens", "max_concurrency", "max_model_len_fit"):
        assert d[key] == getattr(plan, key)


def test_cli_plan_counts_the_lora_slots(capsys):
    """plan --enable-lora counts the --max-loras slots as the engine does (engine/lora/manager.py:slot_bytes) and
    prints the host memory --max-cpu-loras adapters take."""
    import torch

    from quant_serve.engine.config import LoRAConfig
    from quant_serve.engine.load.loader import load_model_config
    from quant_serve.engine.lora.manager import slot_bytes
    from quant_serve.server.cli.main import main
    args = ["plan", str(QWEN), "--kv-cache-dtype", "fp8", "--max-model-len", "8192"]
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--json", "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16"]) == 0
    lora = json.loads(capsys.readouterr().out)
    cfg, _ = load_model_config(QWEN)
    want = slot_bytes(cfg, LoRAConfig(enable_lora=True, max_loras=8, max_lora_rank=16), torch.float16)
    assert lora["lora_bytes"] == want > 0 and plain["lora_bytes"] == 0
    assert lora["weights_bytes"] == plain["weights_bytes"] + want and lora["kv_cache_tokens"] < plain["kv_cache_tokens"]
    assert main([*args, "--enable-lora", "--max-loras", "8", "--max-cpu-loras", "32"]) == 0
    text = capsys.readouterr().out
    assert "of which LoRA" in text and "LoRA host memory: up to 32 adapters x" in text
