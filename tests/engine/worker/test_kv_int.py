"""Integer KV cache (issue #56): the format and torch twin (kernels/attention/kv_int.py), the engine's cache,
block copies and CPU tier carrying the scales, the plan's bytes and the CLI's errors."""
import json

import pytest
import torch

from quant_serve.engine.plan.memory import kv_head_token_bytes, plan_memory
from quant_serve.kernels.attention.kv_int import (IntKVFormat, dequantize_int, format_of, hadamard, int_kv_format,
                                                  quantize_int)
from conftest import QWEN_7B
from helpers import make_engine


@pytest.mark.parametrize("fmt,bound", [(IntKVFormat(8, 64, False), 0.5 / 127), (IntKVFormat(4, 32, False), 0.5 / 7),
                                       (IntKVFormat(4, 16, True), 0.5 / 15)], ids=str)
def test_round_trip_error_within_half_a_step(fmt, bound):
    """|x - deq(q(x))| <= half a quantization step (+ fp16 rounding of scale and zero) per group."""
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    codes, scales = quantize_int(x, fmt)
    assert format_of(codes, scales) == IntKVFormat(fmt.bits, fmt.group, fmt.zero_point)
    assert codes.shape[-1] == (64 if fmt.bits == 8 else 32) and scales.dtype == torch.float16
    y = dequantize_int(codes, scales)
    xg = x.view(50, 3, 64 // fmt.group, fmt.group)
    span = (xg.amax(-1) - xg.amin(-1)) if fmt.zero_point else 2 * xg.abs().amax(-1)
    err = (y - x).abs().view_as(xg).amax(-1)
    assert (err <= span * bound * 1.01 + 2e-3 * span).all()
    assert (y - x).abs().max() > 0                             # it does quantize


def test_int4_packing_order_and_zero_groups():
    x = torch.zeros(1, 1, 4)
    x[0, 0] = torch.tensor([1.0, -1.0, 0.5, 0.0])
    codes, scales = quantize_int(x, IntKVFormat(4, 4, False))
    # scale 1/7: codes 7, -7, 4 (3.5 rounds up), 0, offset by 8; element 0 low nibble, element 1 high nibble
    assert codes.tolist() == [[[15 | (1 << 4), 12 | (8 << 4)]]]
    codes, scales = quantize_int(torch.zeros(2, 1, 8), IntKVFormat(4, 8, True))
    assert torch.equal(dequantize_int(codes, scales), torch.zeros(2, 1, 8))


def test_formats_and_errors():
    assert int_kv_format("fp8", 128) is None
    assert int_kv_format("int8", 128) == IntKVFormat(8, 128, False, False)
    assert int_kv_format("int4", 128) == IntKVFormat(4, 128, False, True)     # a scale per token and head
    assert int_kv_format("int4", 72).group == 72 and not int_kv_format("int4", 72).rotate   # 16 does not divide 72
    with pytest.raises(ValueError, match="group 48 must divide head_dim 64"):
        int_kv_format("int4", 64, group=48)
    with pytest.raises(ValueError, match="int8 is symmetric"):
        int_kv_format("int8", 64, zero_point=True)
    h = hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)


def test_plan_counts_codes_and_scales():
    assert kv_head_token_bytes("int8", "float16", 128) == 128 + 2
    assert kv_head_token_bytes("int4", "float16", 128) == 64 + 2                # one fp16 scale a token and head
    assert kv_head_token_bytes("int4", "float16", 128, group=32, zero_point=True) == 64 + 4 * 2 * 2
    assert kv_head_token_bytes("fp8", "float16", 128) == 128
    plan = plan_memory(QWEN_7B, gpu_mem_gb=24, kv_cache_dtype="int4", max_model_len=32768)
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 66
    # the exact window: 257 rows x 24 tokens of fp16 K and V, beside the CUDA graph reserve
    assert plan.kv_exact_tokens == 24 and plan.exact_window_bytes == 2 * 28 * 257 * 24 * 4 * 128 * 2
    fp8 = plan_memory(QWEN_7B, gpu_mem_gb=24, kv_cache_dtype="fp8", max_model_len=32768)
    assert fp8.exact_window_bytes == 0 and plan.cuda_graph_bytes == fp8.cuda_graph_bytes > 0
    assert plan.kv_cache_tokens >= 1_000_000 and plan.kv_cache_tokens > 1.85 * fp8.kv_cache_tokens   # issue #56
    no_window = plan_memory(QWEN_7B, gpu_mem_gb=24, kv_cache_dtype="int4", max_model_len=32768, kv_exact_tokens=0)
    assert no_window.exact_window_bytes == 0 and no_window.kv_cache_tokens > plan.kv_cache_tokens


def test_engine_cache_scales_ride_with_block_copies_and_swaps(trained_model):
    engine = make_engine(trained_model, num_blocks=16, kv_cache_dtype="int4", num_cpu_blocks=4, max_model_len=64)
    runner = engine.runner
    layer = engine.model.attention_layers[0]
    assert layer.k_cache.dtype == torch.uint8 and layer.k_scale.shape[:2] == (16, 16)
    assert len(runner.block_tensors) == 4 * len(engine.model.attention_layers)
    for t in runner.block_tensors:
        t[3].copy_(torch.randint(0, 100, t[3].shape).to(t.dtype))
    runner.copy_blocks([(3, 9)])
    assert all(torch.equal(t[9], t[3]) for t in runner.block_tensors)
    assert runner.kv_bytes_per_block() == sum(t[0].numel() * t.element_size() for t in runner.block_tensors)
    # the CPU tier holds a twin of every block tensor: swap block 3 out to CPU block 1, then back in as block 7
    tier = runner.cpu_tier
    assert len(tier.cpu_caches) == len(runner.block_tensors) and tier.bytes_per_block == runner.kv_bytes_per_block()
    tier.issue([(3, 1)], [])
    assert all(torch.equal(c[1], t[3]) for c, t in zip(tier.cpu_caches, runner.block_tensors))
    tier.issue([], [(1, 7)])
    assert all(torch.equal(t[7], t[3]) for t in runner.block_tensors)


def test_cli_plan_int4_and_errors(capsys):
    from quant_serve.server.cli.main import main
    from quant_serve.engine.worker.model_runner import kv_cache_torch_dtype
    assert main(["plan", str(QWEN_7B), "--kv-cache-dtype", "int4", "--max-model-len", "32768", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_bytes_per_token"] == 14784 and plan["kv_cache_dtype"] == "int4"
    assert main(["plan", str(QWEN_7B), "--kv-cache-dtype", "int4", "--kv-exact-tokens", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exact_window_bytes"] == 0
    with pytest.raises(SystemExit):
        main(["plan", str(QWEN_7B), "--kv-cache-dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
    assert main(["plan", str(QWEN_7B), "--gpu", "a10", "--kv-cache-dtype", "int4"]) != 0
    assert "error: plan --gpu: the card model has no measurements of --kv-cache-dtype int4" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="supported: auto, .*int8, int4"):
        kv_cache_torch_dtype("int2", torch.float16)


def test_rotated_forward_is_exact_algebra():
    """engine/worker/attention.py's rotation around the cache changes nothing but the stored values: with an fp32
    cache, rotated and plain attention agree to rounding (q.k and P.V are invariant under an orthonormal H)."""
    from quant_serve.engine.worker.attention import AttentionMetadata, paged_attention_forward
    from quant_serve.kernels.attention.reference import build_cos_sin_cache
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(9, h, 64, generator=gen) for h in (4, 2, 2))
    meta = AttentionMetadata(slot_mapping=torch.arange(9), block_tables=torch.tensor([[0]], dtype=torch.int32),
                             seq_lens=torch.tensor([9], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 9], dtype=torch.int32), max_seq_len=9, max_query_len=9)
    cs = build_cos_sin_cache(32, 64)
    outs, stored = [], []
    for rotation in (None, hadamard(64)):
        caches = [torch.zeros(1, 16, 2, 64) for _ in range(2)]
        outs.append(paged_attention_forward(q.clone(), k.clone(), v.clone(), torch.arange(9), cs, *caches, 1.0, 1.0,
                                            meta, 0.125, rotation=rotation))
        stored.append(caches[0][0, :9])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert torch.allclose(stored[1], stored[0] @ hadamard(64), atol=1e-5)        # the cache holds K H
    assert not torch.allclose(stored[1], stored[0], atol=1e-2)
