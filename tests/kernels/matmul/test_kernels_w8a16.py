"""W8A16 Triton kernels (kernels/matmul/planes/kernels.py: split-K GEMV, dequantize + cuBLAS) against the torch twin, and
plan_w8a16's choices. On CPU the kernels run under TRITON_INTERPRET=1 on tiny shapes; on a GPU, compiled."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.triton_compat import interpreting  # noqa: E402
from quant_serve.kernels.matmul.dispatch import w8a16_forward, w8a16_matmul  # noqa: E402
from quant_serve.kernels.matmul.planes.kernels import w8a16_dequantize  # noqa: E402
from quant_serve.kernels.matmul.plan import _PROGRAMS_PER_SM, DOT_MAX_M, W8A16Config, plan_w8a16  # noqa: E402
from quant_serve.kernels.matmul.reference_planes import dequantize_w8, w8a16_matmul_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def w8_weights(k, n, group_size, offsets, scale_dtype=torch.float16, seed=0):
    """Random int8 codes (Q8_0 / Q6_K / Q5_* ranges fit in int8), scales [G, N], offsets or None, on DEV."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size) if 0 < group_size < k else 1
    q = torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8)
    s = (torch.rand(groups, n, generator=g) * 0.002 + 0.0005).to(scale_dtype)
    o = (-torch.rand(groups, n, generator=g) * 0.05).to(scale_dtype) if offsets else None
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return to(q), to(s), to(o)


def reference(x, q, s, o, gs, bias=None):
    return w8a16_matmul_ref(x.cpu().float(), q.cpu(), s.cpu(), None if o is None else o.cpu(), gs,
                            None if bias is None else bias.cpu())


def rel_err(y, ref):
    return ((y.cpu().float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("k,n,gs,offsets,block_k", [(256, 72, 32, True, 64), (208, 40, 16, False, 64),
                                                    (512, 64, 256, True, 64), (200, 48, -1, True, 32),
                                                    (240, 32, 48, True, 32)])
def test_dequantize_equals_twin(k, n, gs, offsets, block_k):
    q, s, o = w8_weights(k, n, gs, offsets)
    want = dequantize_w8(q.cpu(), s.cpu(), None if o is None else o.cpu(), gs)
    dense = w8a16_dequantize(q, s, o, gs, torch.float32, block_n=32, block_k=block_k).cpu()
    if interpreting():     # the same fp32 roundings; compiled, q * s + o may become one fma
        assert torch.equal(dense, want)
    else:
        assert torch.allclose(dense, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("m,dtype,gs,offsets,split_k,block_m", [
    (1, torch.float16, 32, False, 1, 1),         # Q8_0
    (1, torch.bfloat16, 16, True, 3, 1),         # Q6_K-like sub-blocks of 16; split K, bf16
    (4, torch.float16, 32, True, 2, 16),         # Q5_1
    (4, torch.float16, 256, True, 2, 1),
    (16, torch.bfloat16, 32, False, 4, 16),
    (40, torch.float16, 32, True, 2, 32),        # two 32-row blocks, the second partly past M
    (70, torch.bfloat16, 16, False, 1, 64),
])
def test_gemv_matches_twin(m, dtype, gs, offsets, split_k, block_m):
    k, n = 320, 100                              # K not a multiple of the 64-row step, N not of the tile
    q, s, o = w8_weights(k, n, gs, offsets, seed=m)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    bias = torch.randn(n, dtype=dtype, device=DEV)
    y = w8a16_forward(x, q, s, o, gs, bias, W8A16Config("gemv", block_m, 32, 64, split_k))
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, reference(x, q, s, o, gs, bias)) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 4, 17, 64, DOT_MAX_M + 1])
def test_planned_kernel_matches_twin(m):
    k, n, gs = 256, 64, 32
    q, s, o = w8_weights(k, n, gs, True, scale_dtype=torch.float32, seed=m)    # fp32 scales, as a loader may keep
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    y = w8a16_forward(x, q, s, o, gs)
    assert rel_err(y, reference(x, q, s, o, gs)) < TOL[torch.float16]


def test_plan_picks_gemv_rows_up_to_dot_max_m_and_cublas_above():
    """One row a program at M = 1, tl.dot row blocks that cover M (at most 64 rows) up to DOT_MAX_M, dequantize +
    cuBLAS above; K splits that fill the GPU without passing _PROGRAMS_PER_SM programs an SM, fewer for wider
    layers."""
    sms = 132
    for k, n in ((3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)):
        splits = []
        for m in (1, 2, 8, 16, 17, 32, 33, 64, 200, DOT_MAX_M):
            p = plan_w8a16(m, k, n, 32, sms)
            c = p.config
            assert p.kernel == ("gemv" if m == 1 else "gemv-dot") and c.path == "gemv", (m, p)
            assert c.block_m == 1 if m == 1 else min(16, m) <= c.block_m <= 64 and (c.block_m >= m or c.block_m == 64)
            tiles = -(-m // c.block_m) * -(-n // c.block_n)
            assert tiles * c.split_k <= _PROGRAMS_PER_SM * sms or c.split_k == 1, (m, p)
            splits.append(c.split_k)
        assert splits == sorted(splits, reverse=True)          # more rows: no more K splits
    assert plan_w8a16(1, 3584, 3584, 32, sms).config.split_k > 1                 # a narrow layer is split
    assert plan_w8a16(1, 3584, 37888, 32, sms).config.split_k <= plan_w8a16(1, 3584, 3584, 32, sms).config.split_k
    big = plan_w8a16(DOT_MAX_M + 1, 3584, 4608, 32)
    assert big.kernel == "dequant+cublas" and big.config.path == "dequant"
    assert plan_w8a16(17, 256, 64, 16, sms, "q6k").kernel == "dequant+cublas"   # the planes: GEMV to 16 rows


def test_cpu_runs_the_twin_and_cuda_checks_the_layout():
    q, s, o = w8_weights(128, 32, 32, True)
    x = torch.randn(2, 3, 128, dtype=torch.float16)
    y = w8a16_matmul(x, q.cpu(), s.cpu(), o.cpu(), 32)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y.reshape(6, 32), w8a16_matmul_ref(x.reshape(6, 128), q.cpu(), s.cpu(), o.cpu(), 32))
    from quant_serve.kernels.matmul.dispatch import check_w8_layout
    with pytest.raises(ValueError, match="int8"):
        check_w8_layout(128, q.int(), s, o, 32)
    with pytest.raises(ValueError, match="scales"):
        check_w8_layout(128, q, s[:2], o, 32)
    with pytest.raises(ValueError, match="offsets"):
        check_w8_layout(128, q, s, o[:, :4], 32)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,gs", [(3584, 4608, 32), (18944, 3584, 16), (3584, 37888, 32)])
def test_gpu_planned_kernel_on_qwen_shapes(k, n, gs):
    """The planned kernel at the Qwen2.5-7B shapes (split counts of the real plan) against the twin."""
    q, s, o = w8_weights(k, n, gs, True)
    for m in (1, 8, 16, 17, 64, 200, DOT_MAX_M + 1):
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        assert rel_err(w8a16_matmul(x, q, s, o, gs), reference(x, q, s, o, gs)) < TOL[torch.float16], m
