"""The lm_head GEMV (kernels/gemv.py) against F.linear: under TRITON_INTERPRET=1 on CPU, compiled on the GPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel module is imported (decoration time)

from quant_serve.kernels.gemv import gemv, gemv_applies  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 200), (64, 1100), (9, 1536)])
def test_gemv_matches_linear(dtype, n, k):
    """Rows past N (a partial last program), K not a multiple of the 512-column step, one step or three."""
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n + 3, k, generator=gen) * 0.05).to(dtype).to(DEV)[:n]        # a view: stride from the base
    want = torch.nn.functional.linear(x.float(), w.float())
    got = gemv(x, w)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_gemv_rule_and_errors():
    x = torch.randn(1, 64).half()
    assert not gemv_applies(x, torch.randn(70000, 64).half())                # CPU: F.linear
    with pytest.raises(ValueError, match="one row of 64 features"):
        gemv(torch.randn(2, 64).half(), torch.randn(16, 64).half())


@pytest.mark.gpu
def test_gpu_gemv_on_the_qwen_head_and_its_rule(monkeypatch):
    """The Qwen2.5-7B head shape: the GEMV's logits are cuBLAS's up to the fp32 summation order; the rule takes one
    fp16/bf16 row against a vocabulary-wide weight only, and KernelOptions.head_gemv = False turns it off."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3584, generator=gen).half().cuda()
    w = (torch.randn(152064, 3584, generator=gen) * 0.02).half().cuda()
    want = torch.nn.functional.linear(x, w)
    got = gemv(x, w)
    assert (got.float() - want.float()).abs().max().item() < 5e-3
    assert (got.argmax() == want.argmax()).item()
    assert gemv_applies(x, w) and not gemv_applies(x.repeat(2, 1), w) and not gemv_applies(x, w[:4096])
    assert not gemv_applies(x.float(), torch.empty(70000, 3584, device="cuda"))                # fp32
    import dataclasses

    from quant_serve.kernels.gpu import configure, runtime_for
    options = runtime_for(x.device).options
    configure(x.device, dataclasses.replace(options, head_gemv=False))
    try:
        assert not gemv_applies(x, w)
    finally:
        configure(x.device, options)
