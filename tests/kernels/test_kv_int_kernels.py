"""Integer KV cache (issue #56): the Triton store and attention kernels (kernels/attention/kv_int_kernels.py)
against their torch twins (kernels/attention/kv_int.py, reference.py) under the interpreter on small shapes."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.attention.kv_int import IntKVFormat, alloc_int_cache, dequantize_int  # noqa: E402
from quant_serve.kernels.attention.kv_int_paged import paged_attention_int, store_int_triton  # noqa: E402
from quant_serve.kernels.attention.reference import paged_attention_ref, store_kv_ref  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
BS = 16
FORMATS = [IntKVFormat(8, 32, False), IntKVFormat(4, 16, True), IntKVFormat(4, 32, False),
           IntKVFormat(8, 64, False), IntKVFormat(4, 64, False), IntKVFormat(4, 64, True)]   # last three: codes path


def _filled(fmt, num_blocks, heads, head_dim, gen):
    """K and V caches of `fmt` filled by the twin from random values with a few outlier channels."""
    k_c, k_s = alloc_int_cache(fmt, num_blocks, BS, heads, head_dim, DEV)
    v_c, v_s = alloc_int_cache(fmt, num_blocks, BS, heads, head_dim, DEV)
    n = num_blocks * BS
    k = torch.randn(n, heads, head_dim, generator=gen)
    k[..., 3] *= 8                                            # a K outlier channel, as RoPE'd keys have
    v = torch.randn(n, heads, head_dim, generator=gen)
    store_kv_ref(k.half().to(DEV), v.half().to(DEV), k_c, v_c, torch.arange(n, device=DEV), k_s, v_s)
    return k_c, v_c, k_s, v_s


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_store_kernel_writes_the_twins_codes(fmt):
    gen = torch.Generator().manual_seed(0)
    heads, head_dim, num_blocks = 3, 64, 4
    caches = [alloc_int_cache(fmt, num_blocks, BS, heads, head_dim, DEV) for _ in range(4)]
    (kc1, ks1), (vc1, vs1), (kc2, ks2), (vc2, vs2) = caches
    key = (torch.randn(7, heads, head_dim, generator=gen) * 3).half().to(DEV)
    value = torch.randn(7, heads, head_dim, generator=gen).half().to(DEV)
    key[2, 1] = 0                                             # an all-zero group: scale 1, codes of zero
    slots = torch.tensor([5, 17, -1, 40, 63, 0, 33], device=DEV)
    store_kv_ref(key, value, kc1, vc1, slots, ks1, vs1)
    store_int_triton(key, value, kc2, vc2, slots, ks2, vs2)
    for a, b in ((kc1, kc2), (vc1, vc2), (ks1, ks2), (vs1, vs2)):
        assert torch.equal(a.cpu(), b.cpu())
    assert kc2.flatten(0, 1)[slots[slots >= 0]].any()         # something was written
    assert not kc2.flatten(0, 1)[1].any()                     # slot 1 untouched; -1 skipped


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("q_lens, splits", [([1, 1, 1], None), ([1, 1, 1], 4), ([5, 1, 19], None)],
                         ids=["decode", "decode 4 splits", "mixed"])
def test_attention_kernel_matches_twin(fmt, q_lens, splits):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, group, head_dim, num_blocks = 2, 4, 64, 12
    k_c, v_c, k_s, v_s = _filled(fmt, num_blocks, num_kv_heads, head_dim, gen)
    seq_lens = [37, 16, 40]
    pool = torch.randperm(num_blocks, generator=gen)[:9].view(3, 3).to(torch.int32).to(DEV)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEV)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).half().to(DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(q, k_c, v_c, pool, lens, qsl, head_dim ** -0.5, k_s, v_s)
    out = paged_attention_int(q, k_c, v_c, pool, lens, qsl, head_dim ** -0.5, k_s, v_s, block_n=16,
                              num_splits=splits)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 3e-3, err


def test_attention_kernel_window_and_softcap():
    gen = torch.Generator().manual_seed(2)
    fmt = IntKVFormat(4, 32, True)
    k_c, v_c, k_s, v_s = _filled(fmt, 6, 1, 32, gen)
    tables = torch.tensor([[4, 1, 3]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([45], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 6], dtype=torch.int32, device=DEV)
    q = torch.randn(6, 2, 32, generator=gen).half().to(DEV)
    ref = paged_attention_ref(q, k_c, v_c, tables, lens, qsl, 0.2, k_s, v_s, window=8, softcap=5.0)
    out = paged_attention_int(q, k_c, v_c, tables, lens, qsl, 0.2, k_s, v_s, window=8, softcap=5.0, block_n=16)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-3


def test_dequantized_tile_matches_twin_dequantize():
    """The kernel reads what dequantize_int reads: attention over one key equals that key's dequantized value."""
    gen = torch.Generator().manual_seed(3)
    fmt = IntKVFormat(4, 16, True)
    k_c, v_c, k_s, v_s = _filled(fmt, 2, 1, 32, gen)
    tables = torch.tensor([[1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([1], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    out = paged_attention_int(torch.randn(1, 1, 32, generator=gen).half().to(DEV), k_c, v_c, tables, lens, qsl,
                              0.1, k_s, v_s, block_n=16)
    want = dequantize_int(v_c[1, 0], v_s[1, 0])               # [1, 32]
    assert torch.allclose(out[0].float().cpu(), want.cpu(), atol=2e-3)


def test_paged_entry_points_dispatch_integer_caches():
    """paged.py's Triton entry points (what CUDA runs) take an integer cache to the integer kernels: the store and
    the fused RoPE + store write the twin's codes, the prefill entry attends like the twin."""
    from quant_serve.kernels.attention.paged import paged_prefill, rope_store_kv_triton, store_kv_triton
    from quant_serve.kernels.attention.reference import build_cos_sin_cache, rope_store_kv_ref
    gen = torch.Generator().manual_seed(4)
    fmt = IntKVFormat(4, 16, True)
    caches = [alloc_int_cache(fmt, 4, BS, 2, 32, DEV) for _ in range(4)]
    (kc1, ks1), (vc1, vs1), (kc2, ks2), (vc2, vs2) = caches
    q = torch.randn(5, 4, 32, generator=gen).half().to(DEV)
    k = torch.randn(5, 2, 32, generator=gen).half().to(DEV)
    v = torch.randn(5, 2, 32, generator=gen).half().to(DEV)
    pos = torch.tensor([0, 1, 2, 3, 4], device=DEV)
    slots = torch.tensor([16, 17, 18, 19, 20], device=DEV)
    cs = build_cos_sin_cache(64, 32, device=DEV)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    rope_store_kv_ref(q1, k1, v, pos, cs, kc1, vc1, slots, ks1, vs1)
    rope_store_kv_triton(q2, k2, v, pos, cs, kc2, vc2, slots, ks2, vs2)
    assert torch.equal(q1, q2) and torch.equal(kc1, kc2) and torch.equal(ks1, ks2) and torch.equal(vs1, vs2)
    store_kv_triton(k, v, kc2, vc2, slots - 16, ks2, vs2)
    store_kv_ref(k, v, kc1, vc1, slots - 16, ks1, vs1)
    assert torch.equal(kc1, kc2) and torch.equal(vs1, vs2)
    tables = torch.tensor([[1]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([5], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEV)
    ref = paged_attention_ref(q1, kc1, vc1, tables, lens, qsl, 0.2, ks1, vs1)
    out = paged_prefill(q1, kc2, vc2, tables, lens, qsl, 0.2, ks2, vs2, block_n=16)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 3e-3
