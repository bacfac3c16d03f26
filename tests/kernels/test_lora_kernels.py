"""Batched LoRA shrink/expand: the Triton kernels (kernels/lora/triton_kernels.py) against their torch twins
(kernels/lora/reference.py), and the twins against a per-row loop of plain matmuls. Small shapes: on CPU the
kernels run under TRITON_INTERPRET=1."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel module is imported (decoration time)

from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.lora.reference import lora_expand_ref, lora_shrink_ref  # noqa: E402
from quant_serve.kernels.lora.triton_kernels import lora_expand_triton, lora_shrink_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()


def _case(dtype, rows=7, k=96, n=80, r=8, slots_n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    a = (torch.randn(slots_n, r, k, generator=g) * 0.1).to(dtype)
    b = (torch.randn(slots_n, n, r, generator=g) * 0.1).to(dtype)
    slots = torch.tensor([0, -1, 2, 2, -1, 1, 0][:rows], dtype=torch.int32)
    return x, a, b, slots


def test_twins_match_a_per_row_loop():
    x, a, b, slots = _case(torch.float32)
    y = torch.randn(x.shape[0], 100)
    want = y.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[i, 12:92] += (x[i] @ a[s].t()) @ b[s].t()
    h = lora_shrink_ref(x, a, slots)
    assert torch.all(h[slots < 0] == 0)
    got = lora_expand_ref(h, b, slots, y.clone(), col_offset=12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[slots < 0], y[slots < 0])          # base rows untouched, bit for bit


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,n,r", [(96, 80, 8), (200, 33, 16), (64, 128, 5)])
def test_shrink_expand_kernels_match_twins(dtype, k, n, r):
    x, a, b, slots = _case(dtype, k=k, n=n, r=r, seed=k + r)
    x, a, b, slots = x.to(DEV), a.to(DEV), b.to(DEV), slots.to(DEV)
    h = lora_shrink_triton(x, a, slots)
    h_ref = lora_shrink_ref(x.cpu(), a.cpu(), slots.cpu())
    torch.testing.assert_close(h.cpu(), h_ref, rtol=1e-4, atol=1e-4)
    y = torch.randn(x.shape[0], n + 10, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = lora_expand_triton(h_ref.to(DEV), b, slots, y.clone().to(DEV), col_offset=10)
    want = lora_expand_ref(h_ref, b.cpu(), slots.cpu(), y.clone(), col_offset=10)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    assert torch.equal(got.cpu()[:, :10], y[:, :10])                       # columns outside the slice untouched
    assert torch.equal(got.cpu()[slots.cpu() < 0], y[slots.cpu() < 0])     # base rows untouched


def test_kernels_on_a_batch_without_adapters_change_nothing():
    x, a, b, _ = _case(torch.float32)
    slots = torch.full((x.shape[0],), -1, dtype=torch.int32)
    h = lora_shrink_triton(x.to(DEV), a.to(DEV), slots.to(DEV))
    assert torch.count_nonzero(h) == 0
    y = torch.randn(x.shape[0], 80)
    assert torch.equal(lora_expand_triton(h, b.to(DEV), slots.to(DEV), y.clone().to(DEV)).cpu(), y)
