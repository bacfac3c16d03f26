"""W4A16 row-layout Triton kernels with GGUF's float per-group offsets (W = q * s + o) against the torch twin, and
the plan never naming a fragment-layout kernel (no offsets there) for such a layer.

On CPU the kernels run under TRITON_INTERPRET=1 on tiny shapes; on a GPU machine the same tests run compiled.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.gpu import PROFILES, KernelOptions  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.w4a16.dispatch import prepare_kernel_weights, w4a16_forward, w4a16_matmul  # noqa: E402
from quant_serve.kernels.w4a16.plan import layout_for, plan_w4a16  # noqa: E402
from quant_serve.kernels.w4a16.reference import dequantize_w4, pack_int4_rows, w4a16_matmul_ref  # noqa: E402
from quant_serve.kernels.w4a16.rows import W4A16Weights, prepare_w4a16  # noqa: E402
from quant_serve.kernels.w4a16.rows_gemm import w4a16_dequantize  # noqa: E402
from quant_serve.kernels.w4a16.rules import W4A16Config  # noqa: E402
from quant_serve.kernels.triton_compat import interpreting  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def offset_weights(k, n, group_size, dtype, seed=0):
    """A random GGUF-like INT4 layer (Q4_1 / Q4_K: codes 0..15, positive scales, negative offsets about -8 s)
    -> (qweight [K/8, N], scales [G, N], offsets [G, N]) on DEV."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    qweight = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    scales = torch.rand(groups, n, generator=g) * 0.02 + 0.005
    offsets = -scales * (torch.rand(groups, n, generator=g) * 4 + 6)
    return qweight.to(DEV), scales.to(dtype).to(DEV), offsets.to(dtype).to(DEV)


def reference(x, qweight, scales, offsets, group_size, bias=None):
    return w4a16_matmul_ref(x.cpu().float(), qweight.cpu(), scales.cpu(), None, group_size, None,
                            None if bias is None else bias.cpu(), offsets.cpu())


def rel_err(y, ref):
    return ((y.cpu().float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("k,n,group_size,pack_k", [(256, 72, 32, 128), (200, 40, 16, 128), (512, 64, 256, 256)])
def test_dequantize_with_offsets_equals_twin(k, n, group_size, pack_k):
    qweight, scales, offsets = offset_weights(k, n, group_size, torch.float16)
    w = prepare_w4a16(qweight, scales, None, group_size, pack_k=pack_k, offsets=offsets)
    want = dequantize_w4(qweight.cpu(), scales.cpu(), None, group_size, torch.float32, offsets.cpu())
    dense = w4a16_dequantize(w, torch.float32, block_n=32).cpu()
    if interpreting():     # the same two fp32 roundings; compiled, q * s + o may become one fma
        assert torch.equal(dense, want)
    else:
        assert torch.allclose(dense, want, rtol=1e-6, atol=1e-7)
    assert rel_err(w4a16_dequantize(w, torch.float16, block_n=32), want) < 1e-3


@pytest.mark.parametrize("m,dtype,group_size,split_k,variant", [
    (1, torch.float16, 32, 1, {}),
    (1, torch.bfloat16, 16, 3, dict(one_launch=True, pipeline=True)),
    (4, torch.float16, 32, 2, dict(rows=32)),
])
def test_gemv_with_offsets_matches_twin(m, dtype, group_size, split_k, variant):
    k, n = 384, 100                                  # K not a multiple of pack_k (K = 3 chunks), N not of the tile
    qweight, scales, offsets = offset_weights(k, n, group_size, dtype, seed=m)
    w = prepare_w4a16(qweight, scales, None, group_size, offsets=offsets)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    bias = torch.randn(n, dtype=dtype, device=DEV)
    cfg = W4A16Config("gemv", 1, 32, split_k, 4, 2, **variant)
    y = w4a16_forward(x, w, bias, cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, reference(x, qweight, scales, offsets, group_size, bias)) < TOL[dtype]


@pytest.mark.parametrize("m,dtype,group_size,block_m,split_k,path", [
    (4, torch.float16, 32, 16, 2, "gemmt"),
    (17, torch.float16, 32, 32, 1, "gemm"),
    (17, torch.bfloat16, 16, 16, 3, "gemmt"),
    (64, torch.float16, 128, 64, 2, "gemm"),
])
def test_gemm_with_offsets_matches_twin(m, dtype, group_size, block_m, split_k, path):
    k, n = 256, 72
    qweight, scales, offsets = offset_weights(k, n, group_size, dtype, seed=m)
    w = prepare_w4a16(qweight, scales, None, group_size, offsets=offsets)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    y = w4a16_forward(x, w, None, W4A16Config(path, block_m, 32, split_k))
    assert rel_err(y, reference(x, qweight, scales, offsets, group_size)) < TOL[dtype]


def test_dequant_path_and_silu_mul_with_offsets():
    k, n, gs = 256, 64, 32
    qweight, scales, offsets = offset_weights(k, n, gs, torch.float16, seed=3)
    w = prepare_w4a16(qweight, scales, None, gs, offsets=offsets)
    x = torch.randn(17, k, dtype=torch.float16, device=DEV)
    ref = reference(x, qweight, scales, offsets, gs)
    assert rel_err(w4a16_forward(x, w, None, W4A16Config("dequant")), ref) < TOL[torch.float16]
    # SwiGLU fused into the gemv's split-K reduce
    y = w4a16_forward(x[:1], w, None, W4A16Config("gemv", 1, 32, 2), silu_mul=True)
    r = ref[:1]
    assert rel_err(y, torch.nn.functional.silu(r[:, : n // 2]) * r[:, n // 2:]) < 5e-3


def test_cpu_matmul_on_prepared_offsets_runs_the_twin():
    qweight, scales, offsets = offset_weights(128, 32, 32, torch.float16)
    x = torch.randn(3, 128, dtype=torch.float16)
    w = prepare_kernel_weights(qweight.cpu(), scales.cpu(), None, 32, offsets=offsets.cpu())
    assert isinstance(w, W4A16Weights) and w.offsets is not None
    want = w4a16_matmul_ref(x, qweight.cpu(), scales.cpu(), None, 32, offsets=offsets.cpu())
    assert torch.equal(w4a16_matmul(x, w), want)
    assert torch.equal(w4a16_matmul(x, qweight.cpu(), scales.cpu(), None, 32, offsets=offsets.cpu()), want)


def test_offsets_are_checked():
    qweight, scales, offsets = offset_weights(128, 32, 32, torch.float16)
    with pytest.raises(ValueError, match="not both"):
        prepare_w4a16(qweight, scales, torch.zeros(4, 4, dtype=torch.int32, device=DEV), 32, offsets=offsets)
    with pytest.raises(ValueError, match="scales' shape"):
        prepare_w4a16(qweight, scales, None, 32, offsets=offsets[:2])
    w = prepare_w4a16(qweight, scales, None, 32, offsets=offsets.float())
    assert w.offsets.dtype == torch.float16          # cast to the scales' dtype, as the kernels read them


@pytest.mark.parametrize("caps", [PROFILES["h200"], PROFILES["a10"]])
def test_plan_never_picks_a_fragment_kernel_for_offsets(caps):
    """Offsets put a layer in the row layout (the fragment kernels have no offsets); every plan of the row layout
    names a row-layout kernel, all of which take offsets."""
    for k, n, gs in [(3584, 4608, 32), (18944, 3584, 32), (3584, 37888, 32), (256, 64, 16)]:
        assert layout_for(k, n, gs, torch.float16, caps, KernelOptions())[0] == "frag"
        layout, why = layout_for(k, n, gs, torch.float16, caps, KernelOptions(), offsets=True)
        assert layout == "rows" and "offsets" in why
        for m in (1, 4, 16, 17, 64, 128, 4096):
            for silu_mul in (False, True):
                plan = plan_w4a16(m, k, n, caps, KernelOptions(), layout, torch.float16, silu_mul)
                assert plan.kernel in ("gemv", "gemm", "gemmt", "dequant+cublas"), plan
