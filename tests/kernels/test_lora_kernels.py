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
from quant_serve.kernels.lora.triton_kernels import (expand_block_n, lora_expand_triton,  # noqa: E402
                                                     lora_shrink_triton, shrink_splits)

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
    parts, r = [48, 16, 16], 8                      # a merged qkv: each part reads its own rank block of h
    x, a, b, slots = _case(torch.float32, n=sum(parts), r=len(parts) * r)
    b = b[:, :, :r].contiguous()
    y = torch.randn(x.shape[0], sum(parts))
    want = y.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            h = x[i] @ a[s].t()
            col = 0
            for p, n in enumerate(parts):
                want[i, col:col + n] += h[p * r:(p + 1) * r] @ b[s, col:col + n].t()
                col += n
    h = lora_shrink_ref(x, a, slots)
    assert h.shape == (1, x.shape[0], len(parts) * r) and torch.all(h[:, slots < 0] == 0)
    got = lora_expand_ref(h, b, slots, y.clone(), parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[slots < 0], y[slots < 0])          # base rows untouched, bit for bit


@pytest.mark.parametrize("rows,k", [(1, 1100), (2, 96), (7, 200), (300, 64)])
def test_shrink_splits_cover_k_once(rows, k):
    splits, chunk = shrink_splits(rows, k)
    assert chunk % 128 == 0 and (splits - 1) * chunk < k <= splits * chunk
    assert (splits > 1) == (rows == 1 and k > 512)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k,parts,r", [(7, 96, [80], 8), (7, 200, [33], 16), (1, 1100, [64, 32, 32], 8),
                                            (3, 640, [33, 20], 5), (7, 64, [128, 128], 16)])
def test_shrink_expand_kernels_match_twins(dtype, rows, k, parts, r):
    x, a, b, slots = _case(dtype, rows=rows, k=k, n=sum(parts), r=len(parts) * r, seed=k + r)
    b = b[:, :, :r].contiguous()
    x, a, b, slots = x.to(DEV), a.to(DEV), b.to(DEV), slots.to(DEV)
    h = lora_shrink_triton(x, a, slots)
    h_ref = lora_shrink_ref(x.cpu(), a.cpu(), slots.cpu())
    assert h.shape[0] == shrink_splits(rows, k)[0]
    torch.testing.assert_close(h.sum(0, keepdim=True).cpu(), h_ref, rtol=1e-4, atol=1e-4)
    y = torch.randn(rows, sum(parts), generator=torch.Generator().manual_seed(1)).to(dtype)
    got = lora_expand_triton(h, b, slots, y.clone().to(DEV), parts)
    want = lora_expand_ref(h_ref, b.cpu(), slots.cpu(), y.clone(), parts)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    assert torch.equal(got.cpu()[slots.cpu() < 0], y[slots.cpu() < 0])     # base rows untouched


def test_expand_writes_only_its_columns():
    x, a, b, slots = _case(torch.float32, n=80)
    h = lora_shrink_ref(x, a, slots)
    y = torch.randn(x.shape[0], 100)
    got = lora_expand_triton(h.to(DEV), b.to(DEV), slots.to(DEV), y.clone().to(DEV)[:, 12:92])
    assert got.shape == (x.shape[0], 80)
    torch.testing.assert_close(got.cpu(), lora_expand_ref(h, b, slots, y.clone()[:, 12:92]), rtol=1e-5, atol=1e-5)


def test_expand_tiles_never_straddle_parts():
    assert expand_block_n([3584, 512, 512]) == 128 and expand_block_n([512, 128, 128]) == 128
    assert expand_block_n([18944, 18944]) == 128 and expand_block_n([80]) == 128
    assert expand_block_n([48, 16, 16]) == 16 and expand_block_n([33, 20]) == 1


def test_kernels_on_a_batch_without_adapters_change_nothing():
    x, a, b, _ = _case(torch.float32)
    slots = torch.full((x.shape[0],), -1, dtype=torch.int32)
    h = lora_shrink_triton(x.to(DEV), a.to(DEV), slots.to(DEV))
    assert torch.count_nonzero(h) == 0
    y = torch.randn(x.shape[0], 80)
    assert torch.equal(lora_expand_triton(h, b.to(DEV), slots.to(DEV), y.clone().to(DEV)).cpu(), y)
