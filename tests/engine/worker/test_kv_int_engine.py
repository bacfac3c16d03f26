"""Integer KV cache (issue #56) in the engine on the CPU path: greedy output of the trained model with an int8
cache against the fp16 cache, and int4 blocks that swap to the CPU tier or come back from the prefix cache give
exactly the outputs of an engine that never moved them (codes and scales move together, by exact block ids)."""
import pytest

from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, make_engine

PARAMS = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(text_ids):
    return [text_ids[i * 300: i * 300 + 20 + 6 * i] for i in range(4)]


def _generate(engine, prompts):
    return [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS)]


def test_int8_cache_greedy_output_matches_fp16_cache(prompts, trained_model):
    fp16 = _generate(make_engine(trained_model, dtype="float16", max_model_len=128), prompts)
    int8 = _generate(make_engine(trained_model, dtype="float16", max_model_len=128, kv_cache_dtype="int8"),
                     prompts)
    same = sum(a == b for x, y in zip(fp16, int8) for a, b in zip(x, y))
    assert same >= 0.9 * sum(map(len, fp16)), (fp16, int8)
    assert sum(x == y for x, y in zip(fp16, int8)) >= 3          # most completions identical token for token


def test_int4_swaps_to_cpu_tier_are_exact(prompts, trained_model):
    kw = dict(kv_cache_dtype="int4", max_model_len=64, chunk=128)
    ref_engine = make_engine(trained_model, **kw)
    assert ref_engine.model.attention_layers[0].kv_rotation is not None        # the default int4 format rotates
    reference = _generate(ref_engine, prompts)
    engine = make_engine(trained_model, num_blocks=5, num_cpu_blocks=64, **kw)
    assert _generate(engine, prompts) == reference
    assert engine.scheduler.num_swap_preemptions_total >= 1 and engine.stats.swapped_in_blocks_total > 0
    assert_all_blocks_free(engine)


def test_int4_preemption_by_recompute_keeps_the_outputs(prompts, trained_model):
    """Preempted sequences recompute their K/V and refill their exact window from the new tokens (a kept ring row
    reads nothing it did not write since): the outputs of an engine that never preempted."""
    kw = dict(kv_cache_dtype="int4", max_model_len=64, chunk=128)
    reference = _generate(make_engine(trained_model, **kw), prompts)
    engine = make_engine(trained_model, num_blocks=5, **kw)
    assert engine.runner.exact_rows is not None
    assert _generate(engine, prompts) == reference
    assert engine.scheduler.num_preemptions_total >= 2 and engine.scheduler.num_swap_preemptions_total == 0
    assert_all_blocks_free(engine)


def test_int4_prefix_block_evicted_to_cpu_tier_is_hit_later(text_ids, trained_model):
    system = text_ids[1000:1048]                     # 3 full blocks
    first, second = system + text_ids[2000:2008], system + text_ids[3000:3011]
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    expected = make_engine(trained_model, prefix_caching=False, kv_cache_dtype="int4").generate(
        [second], params)[0].outputs[0].token_ids
    engine = make_engine(trained_model, num_blocks=8, max_model_len=128, num_cpu_blocks=16, kv_cache_dtype="int4")
    engine.generate([first], params)
    engine.generate([text_ids[4000:4110]], params)   # 7 blocks: evicts the system prompt's blocks to the CPU tier
    out = engine.generate([second], params)[0]
    assert engine.stats.cpu_prefix_hits_total == 3 and out.num_cached_tokens == len(system)
    assert out.outputs[0].token_ids == expected
    assert_all_blocks_free(engine)


def test_eval_compares_an_int4_cache_against_the_fp16_cache(trained_model, heldout_text, tmp_path):
    """`quant-serve eval --kv-cache-dtype int4` as with fp8: one kv-only candidate, the reference's weights."""
    from quant_serve.eval.harness import EvalConfig, run_eval
    data = tmp_path / "heldout.txt"
    data.write_text(heldout_text)
    result = run_eval(EvalConfig(reference=str(trained_model), data=[str(data)], kv_cache_dtype="int4", tasks=[],
                                 max_tokens=600, layer_windows=1, device="cpu", dtype="float16"))
    (cand,) = result.candidates
    # the report names the format: grouping, zero point, rotation and exact window
    assert cand.kv_cache_dtype == "int4 (one scale per token and head, symmetric, Hadamard-rotated, last 24 tokens " \
        "exact)" and cand.kv_only and cand.name.endswith("kv=int4")
    s = cand.stats.summary()
    assert 0 < s["kld"] < 0.05 and 0.85 < s["top1"] < 1.0            # quantized, yet close to the fp16 cache
    assert result.reference.kv_cache_dtype == "fp16" and cand.kv_scales is None


def test_eval_puts_int4_beside_fp8_in_one_report(trained_model, heldout_text, tmp_path):
    """`quant-serve eval --kv-cache-dtype fp8 int4`: one kv-only candidate each, against the same fp16 cache; the
    command line the report keeps names both."""
    from quant_serve.eval.harness import EvalConfig, run_eval
    from quant_serve.server.cli.main import build_parser
    from quant_serve.server.cli.eval import command_args, config_from_args
    data = tmp_path / "heldout.txt"
    data.write_text(heldout_text)
    args = build_parser().parse_args(["eval", "--reference", str(trained_model), "--data", str(data),
                                      "--kv-cache-dtype", "fp8", "int4", "--tasks", "none", "--max-tokens", "600",
                                      "--layer-windows", "1", "--device", "cpu", "--dtype", "float16"])
    cfg = config_from_args(args)
    assert cfg.kv_cache_dtype == ["fp8", "int4"]
    assert command_args(cfg, args)[command_args(cfg, args).index("--kv-cache-dtype") + 1:][:2] == ["fp8", "int4"]
    result = run_eval(cfg)
    fp8, int4 = result.candidates
    assert fp8.name.endswith("kv=fp8_e4m3") and int4.name.endswith("kv=int4") and fp8.kv_only and int4.kv_only
    assert fp8.kv_cache_dtype == "fp8_e4m3" and int4.kv_cache_dtype.startswith("int4 (")
    assert 0 < fp8.stats.summary()["kld"] < 0.05 and 0 < int4.stats.summary()["kld"] < 0.05
