"""The CPU tier end to end: bit-exact swaps, identical greedy outputs under a too-small GPU pool, prefix hits that
skip recomputation (also when served from the CPU tier)."""
import pytest
import torch

from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.worker.swap import CpuKVTier, block_runs
from helpers import assert_all_blocks_free, make_engine

PARAMS = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(text_ids):
    """6 prompts of 14..44 tokens, no shared prefix: together they need far more than 5 blocks."""
    return [text_ids[i * 150: i * 150 + 14 + 6 * i] for i in range(6)]


@pytest.fixture(scope="module")
def reference(prompts, trained_model):
    engine = make_engine(trained_model, max_model_len=64, chunk=128)
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS)]
    minimal = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts)
    assert engine.runner.num_tokens_forwarded == minimal and engine.scheduler.num_preemptions_total == 0
    return outs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_swap_round_trip_is_bit_exact(dtype, device):
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn((10, 16, 2, 8), generator=gen) * 40).to(dtype).to(device) for _ in range(4)]
    original = [c.clone() for c in caches]
    tier = CpuKVTier(caches, 6)
    assert tier.cpu_caches[0].device.type == "cpu" and tier.cpu_caches[0].is_pinned() == (device == "cuda")
    out_pairs = [(2, 0), (3, 1), (7, 4), (1, 5)]
    tier.issue(out_pairs, [])
    tier.wait()
    for c in caches:
        c.zero_()
    tier.issue([], [(cpu, gpu) for gpu, cpu in out_pairs])   # back to the same blocks
    tier.issue([], [(0, 8), (1, 9)])                          # and copies of two of them elsewhere
    tier.wait()
    if device == "cuda":
        torch.cuda.synchronize()
    for before, after in zip(original, caches):
        assert torch.equal(after[[2, 3, 7, 1]].view(torch.uint8), before[[2, 3, 7, 1]].view(torch.uint8))
        assert torch.equal(after[[8, 9]].view(torch.uint8), before[[2, 3]].view(torch.uint8))
    assert tier.bytes_per_block == 4 * 16 * 2 * 8 * caches[0].element_size()


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([(2, 0), (3, 1), (4, 2), (9, 3), (1, 5), (2, 6)]) == [(2, 0, 3), (9, 3, 1), (1, 5, 2)]
    assert block_runs([]) == []


@pytest.mark.parametrize("num_cpu_blocks, swaps, prefix_caching", [
    (0, "none", True), (64, "all", True), (2, "some", True), (64, "all", False)])
def test_small_gpu_pool_gives_identical_greedy_outputs(prompts, reference, num_cpu_blocks, swaps, prefix_caching,
                                                       trained_model):
    engine = make_engine(trained_model, max_model_len=64, chunk=128, num_blocks=5, num_cpu_blocks=num_cpu_blocks,
                         prefix_caching=prefix_caching)
    outs = [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS)]
    assert outs == reference
    sched, stats = engine.scheduler, engine.stats
    minimal = sum(len(p) + PARAMS.max_tokens - 1 for p in prompts)
    assert sched.num_preemptions_total >= 2
    if swaps == "none":
        assert sched.num_swap_preemptions_total == 0 and stats.swapped_out_blocks_total == 0
        assert engine.runner.num_tokens_forwarded > minimal                  # recompute
    elif swaps == "all":
        assert sched.num_swap_preemptions_total == sched.num_preemptions_total
        assert engine.runner.num_tokens_forwarded == minimal                 # nothing recomputed
    else:
        assert 0 < sched.num_swap_preemptions_total < sched.num_preemptions_total
        assert engine.runner.num_tokens_forwarded > minimal
    if swaps != "none":
        assert stats.swapped_in_blocks_total > 0 and stats.swapped_out_blocks_total >= stats.swapped_in_blocks_total
        assert stats.swap_bytes_total == (stats.swapped_in_blocks_total + stats.swapped_out_blocks_total) * \
            engine.runner.kv_bytes_per_block()
    assert_all_blocks_free(engine)


def _system_prompt_case(text_ids):
    system = text_ids[1000:1048]                     # 3 full blocks
    return system, system + text_ids[2000:2008], system + text_ids[3000:3011]


def test_prefix_hits_on_shared_system_prompt_skip_recomputation(text_ids, trained_model):
    system, first, second = _system_prompt_case(text_ids)
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    expected = make_engine(trained_model, prefix_caching=False).generate([second], params)[0].outputs[0].token_ids
    engine = make_engine(trained_model)
    engine.generate([first], params)
    before, hits = engine.runner.num_tokens_forwarded, engine.block_manager.prefix_hits
    out = engine.generate([second], params)[0]
    assert out.outputs[0].token_ids == expected
    assert out.num_cached_tokens == len(system) == engine.block_manager.prefix_hits - hits
    # computed: the prompt past the cached system prompt, then 3 decode steps (the 4th token is never fed back)
    assert engine.runner.num_tokens_forwarded - before == len(second) - len(system) + 3
    assert_all_blocks_free(engine)


def test_prefix_block_evicted_to_cpu_tier_is_hit_later(text_ids, trained_model):
    system, first, second = _system_prompt_case(text_ids)
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    expected = make_engine(trained_model, prefix_caching=False).generate([second], params)[0].outputs[0].token_ids
    engine = make_engine(trained_model, num_blocks=8, max_model_len=128, num_cpu_blocks=16)
    engine.generate([first], params)
    engine.generate([text_ids[4000:4110]], params)   # 7 blocks: evicts the system prompt's blocks to the CPU tier
    assert engine.stats.swapped_out_blocks_total >= 3
    before = engine.runner.num_tokens_forwarded
    out = engine.generate([second], params)[0]
    assert out.outputs[0].token_ids == expected
    assert engine.stats.cpu_prefix_hits_total == 3 and out.num_cached_tokens == len(system)
    assert engine.stats.swapped_in_blocks_total == 3
    assert engine.runner.num_tokens_forwarded - before == len(second) - len(system) + 3
    assert_all_blocks_free(engine)


@pytest.mark.gpu
def test_swaps_on_cuda_give_identical_outputs(prompts, trained_model):
    model = trained_model
    ref = make_engine(model, max_model_len=64, chunk=128, device="cuda")
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, PARAMS)]
    for num_cpu_blocks in (64, 2):
        engine = make_engine(model, max_model_len=64, chunk=128, num_blocks=5, num_cpu_blocks=num_cpu_blocks,
                             device="cuda")
        assert engine.runner.cpu_tier.cpu_caches[0].is_pinned()
        outs = [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS)]
        assert outs == expected
        assert engine.scheduler.num_swap_preemptions_total > 0 and engine.stats.swapped_in_blocks_total > 0
        assert_all_blocks_free(engine)
    # fp8 cache, async copies of fp8 blocks
    fp8 = dict(max_model_len=64, chunk=128, device="cuda", kv_cache_dtype="fp8_e4m3", kv_scale_source="unit")
    expected = [o.outputs[0].token_ids for o in make_engine(model, **fp8).generate(prompts, PARAMS)]
    engine = make_engine(model, num_blocks=5, num_cpu_blocks=64, **fp8)
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS)] == expected
    assert engine.scheduler.num_swap_preemptions_total > 0
    assert_all_blocks_free(engine)
