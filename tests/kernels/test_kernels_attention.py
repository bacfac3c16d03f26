"""Paged attention, KV store and RoPE Triton kernels vs their torch twins (kernels/attention/reference.py).

On CPU the kernels run under TRITON_INTERPRET=1 on tiny shapes; on a GPU machine the same tests run compiled,
and the `gpu` tests add Qwen2.5-7B attention shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from quant_serve.kernels.attention.reference import (build_cos_sin_cache, paged_attention_ref,  # noqa: E402
                                               rope_store_kv_ref, store_kv_ref)
from quant_serve.kernels.attention.triton_kernels import _e4m3_to_f16, _f32_to_e4m3  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.attention.paged import (DecodeConfig, NewTokens, paged_attention, paged_decode,  # noqa: E402
                                                 paged_prefill, rope_store_kv_triton, store_kv_triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
BS = 16


def make_cache(num_blocks, num_kv_heads, head_dim, dtype, scale, gen):
    """Random K and V caches in `dtype` holding values of about unit size once dequantized."""
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    if dtype in (E4M3, E5M2):
        return (k / scale).to(dtype).to(DEV), (v / scale).to(dtype).to(DEV)
    return k.to(dtype).to(DEV), v.to(dtype).to(DEV)


def make_batch(seq_lens, q_lens, num_blocks, gen):
    """Block tables drawn from a shuffled pool (non-contiguous, shared pool), seq_lens, query_start_loc."""
    max_blocks = max(-(-s // BS) for s in seq_lens)
    pool = torch.randperm(num_blocks, generator=gen)
    tables = pool[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return tables.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl.to(DEV)


def rel_err(y, ref):
    return ((y.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm()).item()


def as_scale(value, tensor):
    return torch.tensor(value, dtype=torch.float32, device=DEV) if tensor else value


@pytest.mark.parametrize("cache_dtype,scale,tensor_scale", [
    (torch.float16, 1.0, False), (torch.bfloat16, 1.0, False), (E4M3, 0.02, True), (E5M2, 0.5, False)])
def test_store_kv_matches_twin(cache_dtype, scale, tensor_scale):
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(7, 2, 24, generator=gen) * 4).to(torch.float16).to(DEV)   # 4 sigma * 1/0.02 > e4m3 max
    value = torch.randn(7, 2, 24, generator=gen).to(torch.float16).to(DEV)
    slots = torch.tensor([3, -1, 17, 40, -1, 0, 63], dtype=torch.int64, device=DEV)
    ours = make_cache(4, 2, 24, cache_dtype, 1.0, gen)
    ref = tuple(c.clone() for c in ours)
    s = as_scale(scale, tensor_scale)
    store_kv_triton(key, value, *ours, slots, s, s)
    store_kv_ref(key, value, *ref, slots, s, s)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16), (torch.bfloat16, E4M3)])
def test_rope_store_kv_matches_twin(dtype, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 5, 6, 2, 32
    cos_sin = build_cos_sin_cache(64, d, base=10000.0, device=DEV)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype).to(DEV) for h in (hq, hkv, hkv))
    positions = torch.tensor([0, 7, 8, 33, 63], device=DEV)
    slots = torch.tensor([5, -1, 6, 20, 31], device=DEV)
    caches = make_cache(2, hkv, d, cache_dtype, 1.0, gen)
    ref_caches = tuple(c.clone() for c in caches)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    scale = as_scale(0.05, True)
    rope_store_kv_triton(q, k, v, positions, cos_sin, *caches, slots, scale, scale)
    rope_store_kv_ref(q_ref, k_ref, v_ref, positions, cos_sin, *ref_caches, slots, scale, scale)
    # fp32 rounding may differ by an ulp (fused multiply-add), which can move a value by one step of its dtype
    torch.testing.assert_close(q, q_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k, k_ref, rtol=1e-2, atol=1e-2)
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.13, atol=0.02)


@pytest.mark.parametrize("hq,hkv,dtype,cache_dtype,splits", [
    (4, 2, torch.float16, torch.float16, 1),
    (4, 2, torch.float16, E4M3, 3),
    (3, 3, torch.bfloat16, E5M2, 2),
    (7, 1, torch.bfloat16, torch.bfloat16, 4),
    (4, 2, torch.float16, torch.float16, 8),      # more splits than 16-token tiles: empty splits
])
def test_decode_matches_twin(hq, hkv, dtype, cache_dtype, splits):
    gen = torch.Generator().manual_seed(hq * 10 + splits)
    d, seq_lens = 32, [1, 17, 40]
    scale = 0.3 if cache_dtype in (E4M3, E5M2) else 1.0
    k_cache, v_cache = make_cache(12, hkv, d, cache_dtype, scale, gen)
    tables, lens, qsl = make_batch(seq_lens, [1, 1, 1], 12, gen)
    q = torch.randn(3, hq, d, generator=gen).to(dtype).to(DEV)
    s = as_scale(scale, splits % 2 == 1)
    out = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s,
                       DecodeConfig(block_n=16, num_splits=splits))
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype,cache_dtype,splits,early", [
    (torch.float16, torch.float16, 1, False), (torch.float16, E4M3, 3, False), (torch.bfloat16, E5M2, 8, False),
    (torch.float16, torch.float16, 1, True), (torch.float16, E4M3, 3, True), (torch.bfloat16, E5M2, 8, True)])
def test_decode_with_new_tokens_matches_rope_store_then_decode(dtype, cache_dtype, splits, early):
    """The decode kernel rotating q/k and storing the new k/v itself (one launch instead of two) gives what
    rope_store_kv + the decode kernel give: same output, same cache bytes (up to an ulp of fused multiply-add);
    a padding row (slot -1) stores nothing. early: the first tile read before the wait (peeled off the loop; a
    one-token context and splits past a context's end leave it empty)."""
    gen = torch.Generator().manual_seed(splits)
    hq, hkv, d, seq_lens = 4, 2, 32, [1, 17, 40, 5]
    scale = 0.3 if cache_dtype in (E4M3, E5M2) else 1.0
    caches = make_cache(12, hkv, d, cache_dtype, scale, gen)
    tables, lens, qsl = make_batch(seq_lens, [1, 1, 1, 1], 12, gen)
    positions = (lens - 1).long()
    slots = tables.long().gather(1, (positions // BS)[:, None])[:, 0] * BS + positions % BS
    slots[3] = -1                                                                   # padding row
    cos_sin = build_cos_sin_cache(64, d, base=10000.0, device=DEV)
    q, k, v = (torch.randn(4, h, d, generator=gen).to(dtype).to(DEV) for h in (hq, hkv, hkv))
    s = as_scale(scale, splits % 2 == 1)
    ref_caches = tuple(c.clone() for c in caches)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    rope_store_kv_ref(q_ref, k_ref, v_ref, positions, cos_sin, *ref_caches, slots, s, s)
    ref = paged_attention_ref(q_ref.float(), *ref_caches, tables, lens, qsl, d ** -0.5, s, s)
    out = paged_decode(q, *caches, tables, lens, qsl, d ** -0.5, s, s,
                       DecodeConfig(block_n=16, num_splits=splits, early_tile=early),
                       new=NewTokens(k, v, positions, cos_sin, slots))
    assert rel_err(out[:3], ref[:3]) < TOL[dtype]
    for a, b in zip(caches, ref_caches):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.13, atol=0.02)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q[:, :, :24], *caches, tables, lens, qsl, 1.0, new=NewTokens(k, v, positions, cos_sin, slots))


@pytest.mark.parametrize("cache_dtype,splits,tensor_scale", [
    (torch.float16, 5, False), (E4M3, 7, True), (E5M2, 3, False)])
def test_decode_partials_merged_later_equal_the_merged_output(cache_dtype, splits, tensor_scale):
    """paged_decode(merge=False) hands back the split partials (for o_proj to merge, kernels/attention/merge.py):
    merge_partials gives the merged call's bytes, the torch twin its values; the splits live_splits counts out
    are empty (m = NEG, l = 0, o = 0: the o_proj staging skips them)."""
    from quant_serve.kernels.attention.merge import DecodePartials, live_splits, merge_partials, merge_partials_ref
    gen = torch.Generator().manual_seed(splits)
    hq, hkv, d, seq_lens = 4, 2, 32, [100, 1, 17]
    scale = 0.3 if cache_dtype in (E4M3, E5M2) else 1.0
    k_cache, v_cache = make_cache(24, hkv, d, cache_dtype, scale, gen)
    tables, lens, qsl = make_batch(seq_lens, [1, 1, 1], 24, gen)
    q = torch.randn(3, hq, d, generator=gen).half().to(DEV)
    s = as_scale(scale, tensor_scale)
    cfg = DecodeConfig(block_n=16, num_splits=splits)
    merged = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s, cfg)
    p = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s, cfg, merge=False)
    assert isinstance(p, DecodePartials) and p.splits == splits and p.features == hq * d and p.tile == 16
    assert torch.equal(merge_partials(p), merged)
    assert rel_err(merge_partials_ref(p), merged.float()) < 1e-3
    for b, n in enumerate(seq_lens):
        live = live_splits(n, splits, 16)
        assert (p.ml[b, :, live - 1, 1] > 0).all()                      # the last live split holds tokens
        assert (p.ml[b, :, live:, 1] == 0).all() and (p.o[b, :, live:] == 0).all()
        assert (p.ml[b, :, live:, 0] < -1e29).all()
    one = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s, DecodeConfig(num_splits=1),
                       merge=False)
    assert isinstance(one, torch.Tensor)                                 # one split: nothing to merge


@pytest.mark.parametrize("hq,hkv,dtype,cache_dtype", [
    (6, 2, torch.float16, torch.float16), (4, 4, torch.bfloat16, E5M2), (4, 1, torch.float16, E4M3)])
def test_prefill_matches_twin(hq, hkv, dtype, cache_dtype):
    gen = torch.Generator().manual_seed(hq + hkv)
    d = 32
    seq_lens, q_lens = [5, 30, 36, 3], [5, 1, 20, 0]          # no prefix, a decode row, chunk after a prefix, idle
    scale = 0.25 if cache_dtype in (E4M3, E5M2) else 1.0
    k_cache, v_cache = make_cache(12, hkv, d, cache_dtype, scale, gen)
    tables, lens, qsl = make_batch(seq_lens, q_lens, 12, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(DEV)
    out = paged_prefill(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, scale, scale, block_m=32, block_n=16,
                        num_warps=4)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, scale, scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float16, E4M3])
def test_mixed_step_splits_decodes_from_prefills(cache_dtype):
    """engine.attention.attend: the leading one-token sequences of a mixed step go to the decode path, the rest to
    the prefill path (relative query starts); together they equal one attention over the whole batch."""
    from quant_serve.engine.worker.attention import AttentionMetadata, attend
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 4, 2, 32
    seq_lens, q_lens = [40, 17, 64, 50, 9], [1, 1, 1, 20, 9]     # three decodes, a chunk after a prefix, a prompt
    scale = 0.25 if cache_dtype == E4M3 else 1.0
    k_cache, v_cache = make_cache(24, hkv, d, cache_dtype, scale, gen)
    tables, lens, qsl = make_batch(seq_lens, q_lens, 24, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(torch.float16).to(DEV)
    starts = qsl.tolist()
    meta = AttentionMetadata(slot_mapping=torch.full((sum(q_lens),), -1, device=DEV), block_tables=tables,
                             seq_lens=lens, query_start_loc=qsl, max_seq_len=64, max_query_len=20, num_decodes=3,
                             prefill_query_start_loc=torch.tensor([s - 3 for s in starts[3:]], dtype=torch.int32,
                                                                  device=DEV))
    out = attend(q, k_cache, v_cache, meta, d ** -0.5, scale, scale)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, scale, scale)
    assert rel_err(out, ref) < TOL[torch.float16]


def test_twin_window_and_softcap_match_dense_attention():
    """The twin's sliding window and soft-cap against dense attention with the Hugging Face masks (a query at
    position p sees keys p - window + 1 .. p; scores capped by softcap * tanh(s / softcap) before the mask)."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, window, cap = 4, 2, 16, 7, 2.0
    seq_lens, q_lens = [30, 21], [12, 1]                        # a chunk after a prefix, a decode
    k_cache, v_cache = (c.cpu() for c in make_cache(8, hkv, d, torch.float32, 1.0, gen))
    tables, lens, qsl = (t.cpu() for t in make_batch(seq_lens, q_lens, 8, gen))
    q = torch.randn(sum(q_lens), hq, d, generator=gen) * 3
    out = paged_attention_ref(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, window=window, softcap=cap)
    for b, (n, m) in enumerate(zip(seq_lens, q_lens)):
        k = k_cache[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)      # [n, Hq, D]
        v = v_cache[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(hq // hkv, dim=1)
        qb = q[qsl[b]:qsl[b + 1]]                                                            # [m, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * d ** -0.5
        scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(n - m, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        scores = scores.masked_fill(~((k_pos <= q_pos) & (k_pos > q_pos - window)), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, atol=1e-5, rtol=1e-5)
    plain = paged_attention_ref(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5)
    assert not torch.allclose(plain, out, atol=1e-3)               # both options change the output


@pytest.mark.parametrize("splits,early,rope,window,softcap", [
    (1, False, False, 20, 0.0), (3, False, False, 9, 1.5), (8, False, False, 33, 0.0),
    (4, True, True, 20, 0.0), (3, True, True, 5, 1.5), (1, False, True, 64, 1.5), (5, False, False, 0, 1.5)])
def test_decode_window_softcap_matches_twin(splits, early, rope, window, softcap):
    """Sliding window and soft-cap in the decode kernel (splits below the window store empty partials; the
    folded RoPE + store path too) against the twin."""
    gen = torch.Generator().manual_seed(splits * 7 + window)
    hq, hkv, d, seq_lens = 4, 2, 32, [1, 17, 40, 63]
    k_cache, v_cache = make_cache(20, hkv, d, torch.float16, 1.0, gen)
    tables, lens, qsl = make_batch(seq_lens, [1] * 4, 20, gen)
    q = (torch.randn(4, hq, d, generator=gen) * 2).half().to(DEV)
    cfg = DecodeConfig(block_n=16, num_splits=splits, early_tile=early)
    if rope:
        positions = (lens - 1).long()
        slots = tables.long().gather(1, (positions // BS)[:, None])[:, 0] * BS + positions % BS
        cos_sin = build_cos_sin_cache(64, d, base=10000.0, device=DEV)
        k, v = (torch.randn(4, hkv, d, generator=gen).half().to(DEV) for _ in range(2))
        ref_caches = (k_cache.clone(), v_cache.clone())
        q_ref = q.clone()
        rope_store_kv_ref(q_ref, k.clone(), v.clone(), positions, cos_sin, *ref_caches, slots)
        ref = paged_attention_ref(q_ref.float(), *ref_caches, tables, lens, qsl, d ** -0.5, window=window,
                                  softcap=softcap)
        out = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, cfg=cfg,
                           new=NewTokens(k, v, positions, cos_sin, slots), window=window, softcap=softcap)
    else:
        ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, window=window,
                                  softcap=softcap)
        out = paged_decode(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, cfg=cfg, window=window,
                           softcap=softcap)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (23, 1.5), (0, 1.5)])
def test_prefill_window_softcap_matches_twin(window, softcap):
    gen = torch.Generator().manual_seed(window)
    hq, hkv, d = 4, 2, 32
    seq_lens, q_lens = [40, 30, 36, 3], [40, 1, 20, 0]        # a prompt, a decode row, a chunk after a prefix, idle
    k_cache, v_cache = make_cache(12, hkv, d, torch.float16, 1.0, gen)
    tables, lens, qsl = make_batch(seq_lens, q_lens, 12, gen)
    q = (torch.randn(sum(q_lens), hq, d, generator=gen) * 2).half().to(DEV)
    out = paged_prefill(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, block_m=32, block_n=16, num_warps=4,
                        window=window, softcap=softcap)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, window=window,
                              softcap=softcap)
    assert rel_err(out, ref) < TOL[torch.float16]


def test_dispatchers_use_twins_on_cpu():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (c.cpu() for c in make_cache(4, 1, 16, torch.float32, 1.0, gen))
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    q = torch.randn(3, 2, 16, generator=gen)
    args = (q, k_cache, v_cache, tables, torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 0.25)
    assert torch.equal(paged_attention(*args), paged_attention_ref(*args))


# ---- GPU: Qwen2.5-7B attention shapes (28 q heads, 4 kv heads, head_dim 128) ----
@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.float16, E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_qwen_decode_prefill_store(dtype, cache_dtype):
    gen = torch.Generator().manual_seed(4)
    hq, hkv, d = 28, 4, 128
    scale = 0.4 if cache_dtype in (E4M3, E5M2) else 1.0
    k_cache, v_cache = make_cache(2048, hkv, d, cache_dtype, scale, gen)
    seq_lens = [1, 15, 16, 17, 300, 1000, 4095, 2048]
    s = as_scale(scale, True)
    tables, lens, qsl = make_batch(seq_lens, [1] * 8, 2048, gen)
    q = torch.randn(8, hq, d, generator=gen).to(dtype).to(DEV)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s)
    assert rel_err(paged_attention(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s), ref) < TOL[dtype]
    q_lens = [1, 15, 1, 17, 300, 1, 512, 0]                    # mixed chunks, prefixes and decode rows
    tables, lens, qsl = make_batch(seq_lens, q_lens, 2048, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(DEV)
    ref = paged_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s)
    assert rel_err(paged_attention(q, k_cache, v_cache, tables, lens, qsl, d ** -0.5, s, s), ref) < TOL[dtype]
    key, value = (torch.randn(64, hkv, d, generator=gen).to(dtype).to(DEV) * 3 for _ in range(2))
    slots = torch.randperm(2048 * BS, generator=gen)[:64].to(DEV)
    slots[::5] = -1
    ours = (k_cache.clone(), v_cache.clone())
    store_kv_triton(key, value, *ours, slots, s, s)
    store_kv_ref(key, value, k_cache, v_cache, slots, s, s)
    assert torch.equal(ours[0].view(torch.uint8), k_cache.view(torch.uint8))
    assert torch.equal(ours[1].view(torch.uint8), v_cache.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_gpu_fp8_decode_asm_widening_equals_triton_cast(cache_dtype):
    """The decode kernel's inline-asm fp8 -> fp16 widening (attention_triton._widen) gives what Triton's own cast
    gives: both are exact, so the outputs agree to rounding of the same sums."""
    import quant_serve.kernels.attention.paged as pa
    from quant_serve.kernels.gpu import runtime_for
    if not runtime_for(torch.device(DEV)).caps.fp8_cvt:
        pytest.skip(f"the {runtime_for(torch.device(DEV)).caps.profile} GPU profile has no fp8 conversion")
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache = make_cache(512, 4, 128, cache_dtype, 0.4, gen)
    tables, lens, qsl = make_batch([1, 77, 600, 2048], [1] * 4, 512, gen)
    q = torch.randn(4, 28, 128, generator=gen).to(torch.float16).to(DEV)
    s = as_scale(0.4, True)
    assert pa._fp8_cvt(q, cache_dtype)
    ours, cast = (paged_decode(q, k_cache, v_cache, tables, lens, qsl, 128 ** -0.5, s, s,
                               DecodeConfig(block_n=128, fp8_asm=asm)) for asm in (True, False))
    assert (ours.float() - cast.float()).abs().max().item() < 2e-3


def compile_decode_sm90() -> dict:
    """The fp8 decode kernel with and without the asm widening, compiled for sm90 -> narrow shared loads (LDS) and
    registers of each (a fresh process: the CPU tests' interpreter mode patches Triton's builder)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quant_serve.kernels.attention.triton_kernels import _decode_kernel
    from kernel_helpers import cubin_sass
    sig = dict(q_ptr="*fp16", k_cache="*fp8e4nv", v_cache="*fp8e4nv", tables_ptr="*i32", seq_lens_ptr="*i32",
               qsl_ptr="*i32", out_ptr="*fp16", part_o="*fp32", part_ml="*fp32", k_scale_ptr="*fp32",
               v_scale_ptr="*fp32", k_scale_val="fp32", v_scale_val="fp32", qk_scale="fp32", D="i32", window="i32",
               stride_qt="i32", stride_qh="i32", stride_ot="i32", stride_oh="i32", stride_tb="i32",
               stride_cb="i32", stride_cs="i32", stride_ch="i32", k_new_ptr="*fp16", v_new_ptr="*fp16",
               pos_ptr="*i64", cos_sin_ptr="*fp16", slot_ptr="*i64", stride_kt="i32", stride_kh="i32",
               stride_vt="i32", stride_vh="i32", stride_pos="i32")
    aligned = ("q_ptr", "k_cache", "v_cache", "out_ptr", "part_o", "part_ml", "D", "stride_qt", "stride_qh",
               "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch")
    out = {}
    for cvt in (False, True):
        constexprs = dict(G=7, GP=16, BLOCK_N=64, BLOCK_D=128, BLOCK_SIZE=16, SPLIT=True, IS_FP8=True,
                          SCALE_PTR=True, PDL=True, ROPE=False, FMAX=448.0, FP8_CVT=cvt, EARLY_TILE=False,
                          SOFTCAP=0.0)
        full = dict(sig, **{k: "constexpr" for k in constexprs})
        names = list(full)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        regs, stack, sass = cubin_sass(triton.compile(
            ASTSource(fn=_decode_kernel, signature=full, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}))
        out[str(cvt)] = {"regs": regs, "stack": stack, "lds": len(re.findall(r"\bLDS\b", sass))}
    return out


def test_fp8_decode_widens_before_the_layout_change_on_sm90():
    """Left to Triton, the fp8 tile goes through shared memory to the MMA operand layout as bytes (~100 narrow
    loads a 64-token step) and is widened after; the asm widening keeps the fp16 path's shape."""
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.test_kernels_attention", "compile_decode_sm90")
    assert res["True"]["stack"] == 0, res
    assert res["True"]["lds"] * 3 < res["False"]["lds"], res


def test_decode_config_rule(monkeypatch):
    """The fitted rule (kernels/attention/paged.decode_config): few programs split the context finely, many keep it
    whole; fp8 tiles are widened by asm only on short tables; a CUDA graph's table keeps the coarse rule; the split
    count stays within the merge kernel's."""
    import quant_serve.kernels.attention.paged as pa
    from quant_serve.kernels.attention.paged import MAX_SPLITS, decode_config, decode_splits
    few16, many16 = decode_config(False, 4, 4096), decode_config(False, 256, 4096)
    assert (few16.block_n, few16.waves, few16.min_split_tokens) == (64, 8.0, 64)
    assert (many16.waves, many16.min_split_tokens) == (2.0, 256)
    assert decode_config(True, 16, 512).fp8_asm and not decode_config(True, 16, 4096).fp8_asm
    assert decode_config(True, 256, 512) == DecodeConfig(block_n=128, num_stages=3)    # many programs, fp8
    one = decode_config(True, 4, 1024)                               # batch 1: 64-token tiles widened by asm
    assert (one.block_n, one.min_split_tokens, one.fp8_asm) == (64, 64, True)
    assert decode_config(True, 4, 2048) == decode_config(True, 16, 2048)
    assert decode_config(False, 4, 4096, wide_table=True) == DecodeConfig()         # a CUDA graph's table
    assert decode_config(True, 4, 512, wide_table=True) == DecodeConfig(block_n=128)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)                         # an H100/H200
    cuda = torch.device("cuda", 0)
    assert decode_splits(4, 32768, cuda, few16) == MAX_SPLITS          # 264 wanted
    assert decode_splits(4, 512, cuda, few16) == 8                      # 64-token splits
    assert decode_splits(1024, 8192, cuda, many16) == 1


def test_decode_graph_contexts(monkeypatch):
    """Few programs: a graph per table width, doubling from 1024 tokens to max_model_len, less the widths whose launch
    (configuration, split count) the next wider one repeats; many: one wide table."""
    import quant_serve.kernels.attention.paged as pa
    from quant_serve.kernels.attention.paged import FEW_PROGRAMS, decode_graph_contexts
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)                         # an H100/H200
    cuda = torch.device("cuda", 0)
    assert decode_graph_contexts(4, 4096, False, cuda) == [1024, 2048, 4096]
    # fp16, 4 programs: 16, 32, 64 splits, then 128 (the cap) from 8,192 tokens on: 8,192 and 16,384 repeat 32,768
    assert decode_graph_contexts(4, 32768, False, cuda) == [1024, 2048, 4096, 32768]
    assert decode_graph_contexts(4, 32768, True, cuda) == [1024, 2048, 4096, 8192, 32768]
    assert decode_graph_contexts(FEW_PROGRAMS, 3000, False, cuda) == [1024, 3000]        # 16 splits, then 17
    assert decode_graph_contexts(8, 512, False, cuda) == [512]
    assert decode_graph_contexts(FEW_PROGRAMS + 1, 32768, False, cuda) == [32768]
    from quant_serve.engine.worker.cuda_graph import DecodeGraphs
    on_gpu = pa.decode_splits                              # as on an H200, though the buffers here are on the CPU
    monkeypatch.setattr(pa, "decode_splits", lambda programs, ctx, device, cfg: on_gpu(programs, ctx, cuda, cfg))
    graphs = DecodeGraphs(None, 64, 4096, 16, torch.device("cpu"), num_kv_heads=4)     # Qwen2.5-7B heads
    assert (graphs.widths[1], graphs.widths[16], graphs.widths[24]) == ([64, 128, 256], [64, 256], [256])
    assert not graphs.wide[16] and graphs.wide[24]            # the fine rule over each width, the coarse one above
    short = DecodeGraphs(None, 8, 512, 16, torch.device("cpu"), num_kv_heads=4)       # one width, yet few programs
    assert short.widths[1] == [32] and not short.wide[1]

@triton.jit
def _convert_e4m3(bits_ptr, wide_ptr, x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(wide_ptr + i, _e4m3_to_f16(tl.load(bits_ptr + i)))
    tl.store(out_ptr + i, _f32_to_e4m3(tl.load(x_ptr + i)))


def test_software_e4m3_conversions_are_exact():
    """The byte path of GPUs without fp8 conversion (sm80 / sm86): every finite e4m3 pattern widens to its exact
    value, and fp32 values (normals, subnormals, ties, the clamp bound, signed zeros) round as torch rounds."""
    bits = torch.arange(256, dtype=torch.uint8)
    bits[bits.bitwise_and(0x7F) == 0x7F] = 0                                  # the two NaN patterns
    gen = torch.Generator().manual_seed(0)
    grid = torch.arange(1, 512, dtype=torch.float32) / 512                   # every subnormal step and tie
    values = torch.cat([grid * 2 ** -6, grid * 2 ** -6 + 2 ** -10, torch.randn(2048, generator=gen) * 40,
                        torch.rand(512, generator=gen) * 2 ** -8, torch.tensor([448.0, -448.0, 0.0, -0.0, 1.0])])
    values = torch.cat([values, -values])[:4096].clamp(-448, 448)
    n = values.numel()
    bits_in = bits.repeat(n // 256).to(DEV)
    wide = torch.empty(n, dtype=torch.float16, device=DEV)
    out = torch.empty(n, dtype=torch.uint8, device=DEV)
    _convert_e4m3[(1,)](bits_in, wide, values.to(DEV), out, N=n)
    exact = bits_in.cpu().view(E4M3).to(torch.float16)
    assert torch.equal(wide.cpu(), exact)
    assert torch.equal(out.cpu(), values.to(E4M3).view(torch.uint8))


def test_software_e4m3_cache_path_matches_the_fp8_type(monkeypatch):
    """An e4m3 cache handed to the kernels as bytes (paged_attention.e4m3_in_software: no fp8 conversion on the
    GPU) stores the same bytes and attends to the same values as the fp8-typed path: store, fused RoPE + store,
    decode with new tokens, prefill."""
    import quant_serve.kernels.attention.paged as pa
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, seq_lens = 4, 2, 32, [1, 17, 40, 5]
    caches = make_cache(12, hkv, d, E4M3, 0.3, gen)
    tables, lens, qsl = make_batch(seq_lens, [1, 1, 1, 1], 12, gen)
    positions = (lens - 1).long()
    slots = tables.long().gather(1, (positions // BS)[:, None])[:, 0] * BS + positions % BS
    cos_sin = build_cos_sin_cache(64, d, base=10000.0, device=DEV)
    q, k, v = (torch.randn(4, h, d, generator=gen).half().to(DEV) * 3 for h in (hq, hkv, hkv))
    s = as_scale(0.3, True)

    def run(software: bool):
        monkeypatch.setattr(pa, "e4m3_in_software", lambda device: software)
        cs = tuple(c.clone() for c in caches)
        store_kv_triton(k, v, *cs, slots.flip(0), s, s)
        qr, kr = q.clone(), k.clone()
        rope_store_kv_triton(qr, kr, v, positions, cos_sin, *cs, slots, s, s)
        dec = paged_decode(q, *cs, tables, lens, qsl, d ** -0.5, s, s, DecodeConfig(block_n=16, num_splits=3),
                           new=NewTokens(k, v, positions, cos_sin, slots))
        pre = paged_prefill(q, *cs, tables, lens, torch.arange(5, dtype=torch.int32, device=DEV), d ** -0.5, s, s)
        return cs, qr, dec, pre

    typed, software = run(False), run(True)
    for a, b in zip(typed[0], software[0]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(typed[1:], software[1:]):
        assert torch.equal(a, b)
