"""The integer cache's fused prologue and the rotation back (kernels/attention/kv_int_prologue.py) against the torch
sequence they replace (engine/worker/attention._int_forward's CPU path: RoPE, rotation, store), under the
interpreter on small shapes."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.attention.kv_int import (IntKVFormat, alloc_int_cache, dequantize_int,  # noqa: E402
                                                  hadamard)
from quant_serve.kernels.attention.kv_int_prologue import int_prologue_triton, rotate_triton  # noqa: E402
from quant_serve.kernels.attention.reference import (apply_rope_ref, build_cos_sin_cache,  # noqa: E402
                                                     store_kv_ref)
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
BS = 16


def _twin(q, k, v, positions, cos_sin, rotation):
    q, k = apply_rope_ref(q, positions, cos_sin), apply_rope_ref(k, positions, cos_sin)
    if rotation is not None:
        q, k, v = [(x.float() @ rotation).to(x.dtype) for x in (q, k, v)]
    return q, k, v


@pytest.mark.parametrize("fmt, rotate", [(IntKVFormat(4, 64, False), True), (IntKVFormat(8, 64, False), False),
                                         (IntKVFormat(4, 16, True), True)], ids=["int4-rot", "int8", "int4-zp"])
def test_prologue_matches_the_torch_sequence(fmt, rotate):
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d, num_blocks = 6, 6, 2, 64, 3
    q = torch.randn(tokens, hq, d, generator=gen).half().to(DEV)
    k = (torch.randn(tokens, hkv, d, generator=gen) * 2).half().to(DEV)
    v = torch.randn(tokens, hkv, d, generator=gen).half().to(DEV)
    positions = torch.tensor([0, 5, 17, 3, 40, 9], device=DEV)
    slots = torch.tensor([4, -1, 20, 33, 0, 47], device=DEV)
    cos_sin = build_cos_sin_cache(64, d, device=DEV)
    rotation = hadamard(d, DEV) if rotate else None
    (kc1, ks1), (vc1, vs1), (kc2, ks2), (vc2, vs2) = [alloc_int_cache(fmt, num_blocks, BS, hkv, d, DEV)
                                                      for _ in range(4)]
    want = _twin(q, k, v, positions, cos_sin, rotation)
    store_kv_ref(want[1], want[2], kc1, vc1, slots, ks1, vs1)
    got = int_prologue_triton(q, k, v, positions, cos_sin, rotate, kc2, vc2, slots, ks2, vs2)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g.float().cpu(), w.float().cpu(), rtol=2e-3, atol=2e-3)
    for codes1, scales1, codes2, scales2 in ((kc1, ks1, kc2, ks2), (vc1, vs1, vc2, vs2)):
        a, b = dequantize_int(codes1, scales1).float(), dequantize_int(codes2, scales2).float()
        err = ((a - b).norm() / a.norm()).item()
        assert err < 2e-2, err                        # codes may differ by one where a value sits on a boundary
    written = kc2.flatten(0, 1)
    assert written[slots[slots >= 0]].any() and not written[1].any()       # slot -1 skipped, slot 1 untouched


def test_prologue_in_place_on_views_of_one_qkv_row():
    """The unrotated store path (int8) writes q and k back into the qkv projection's output, whose heads are views
    with the whole row as token stride; v, not rotated, is left as it is."""
    gen = torch.Generator().manual_seed(5)
    tokens, hq, hkv, d = 5, 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).half().to(DEV)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    positions = torch.tensor([3, 0, 9, 1, 30], device=DEV)
    slots = torch.tensor([0, 1, 2, -1, 17], device=DEV)
    cos_sin = build_cos_sin_cache(32, d, device=DEV)
    fmt = IntKVFormat(8, d, False)
    (kc1, ks1), (vc1, vs1), (kc2, ks2), (vc2, vs2) = [alloc_int_cache(fmt, 2, BS, hkv, d, DEV) for _ in range(4)]
    want = _twin(q.clone(), k.clone(), v.clone(), positions, cos_sin, None)
    store_kv_ref(want[1], want[2], kc1, vc1, slots, ks1, vs1)
    v_before = v.clone()
    int_prologue_triton(q, k, v, positions, cos_sin, False, kc2, vc2, slots, ks2, vs2, out=(q, k, v))
    torch.testing.assert_close(q.float().cpu(), want[0].float().cpu(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(k.float().cpu(), want[1].float().cpu(), rtol=2e-3, atol=2e-3)
    assert torch.equal(v, v_before)
    for a, b in ((kc1, kc2), (vc1, vc2), (ks1, ks2), (vs1, vs2)):
        assert torch.equal(a.cpu(), b.cpu())        # unrotated: the same values, so the same codes and scales


def test_rotate_back_matches_torch():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 32, generator=gen).half().to(DEV)
    rotation = hadamard(32, DEV)
    got = rotate_triton(x)
    torch.testing.assert_close(got.float().cpu(), (x.float() @ rotation).half().float().cpu(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(rotate_triton(got).float().cpu(), x.float().cpu(), rtol=5e-3, atol=5e-3)
