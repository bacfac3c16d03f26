"""Fused RMSNorm (+ residual) and SiLU-and-mul Triton kernels vs their torch twins (kernels/norm_act.py).

On CPU they run under TRITON_INTERPRET=1 on small shapes; on a GPU machine the same tests run compiled."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel module is imported (decoration time)

from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.norm_act import (rms_norm, rms_norm_ref, rms_norm_triton, silu_and_mul_ref,  # noqa: E402
                                          silu_and_mul_triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def ulp_close(got, want, dtype):
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 96, 200])
def test_rms_norm_matches_twin(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(DEV)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    ulp_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_with_residual_matches_twin(dtype):
    gen = torch.Generator().manual_seed(0)
    x, residual = ((torch.randn(7, 160, generator=gen) * 4).to(dtype).to(DEV) for _ in range(2))
    weight = torch.rand(160, generator=gen).to(dtype).to(DEV)
    normed, stream = rms_norm_triton(x, weight, 1e-5, residual)
    want_normed, want_stream = rms_norm_ref(x, weight, 1e-5, residual)
    assert torch.equal(stream, want_stream)               # the residual add rounds exactly like torch's
    ulp_close(normed, want_normed, dtype)


def test_rms_norm_leaves_its_inputs_alone():
    x = torch.randn(3, 64).half().to(DEV)
    residual = torch.randn(3, 64).half().to(DEV)
    x0, r0 = x.clone(), residual.clone()
    rms_norm_triton(x, torch.ones(64).half().to(DEV), 1e-6, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_rms_norm_dispatch_keeps_cpu_on_the_twin():
    x, w = torch.randn(2, 32), torch.ones(32)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [48, 100])
def test_silu_and_mul_matches_twin(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=gen) * 5).to(dtype).to(DEV)
    ulp_close(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up), dtype)


@pytest.mark.gpu
def test_qwen_shapes_on_gpu():
    x, residual = (torch.randn(256, 3584, device="cuda").half() for _ in range(2))
    weight = torch.rand(3584, device="cuda").half()
    normed, stream = rms_norm_triton(x, weight, 1e-6, residual)
    want_normed, want_stream = rms_norm_ref(x, weight, 1e-6, residual)
    assert torch.equal(stream, want_stream)
    ulp_close(normed, want_normed, torch.float16)
    gate_up = torch.randn(256, 2 * 18944, device="cuda").half() * 4
    ulp_close(silu_and_mul_triton(gate_up), silu_and_mul_ref(gate_up), torch.float16)
