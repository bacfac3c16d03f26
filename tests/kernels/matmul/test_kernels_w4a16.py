"""W4A16 Triton kernels vs the torch twin (kernels/matmul/reference.py).

On CPU the Triton kernels run under TRITON_INTERPRET=1 on tiny shapes; on a GPU machine the same tests run the
compiled kernels, and the `gpu` tests add the Qwen2.5-7B layer shapes.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.matmul.dispatch import standard_layout, w4a16_forward, w4a16_matmul  # noqa: E402
from quant_serve.kernels.matmul.rows.layout import prepare_w4a16  # noqa: E402
from quant_serve.kernels.matmul.rows.gemm import w4a16_dequantize  # noqa: E402
from quant_serve.kernels.matmul.reference import dequantize_w4, w4a16_matmul_ref  # noqa: E402
from quant_serve.kernels.matmul.rules import W4A16Config  # noqa: E402
from kernel_helpers import make_weights, reference, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()


TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("k,pack_k,group_size", [(256, 128, 32), (200, 128, -1), (512, 256, 64)])
def test_layout_roundtrip_and_dequant_exact(k, pack_k, group_size):
    qweight, scales, qzeros, gs, _ = make_weights(k, 72, group_size, True, False, torch.float16)
    w = prepare_w4a16(qweight, scales, qzeros, gs, pack_k=pack_k)
    back = standard_layout(w)
    assert torch.equal(back[0], qweight)
    for dtype in (torch.float32, torch.float16):
        dense = w4a16_dequantize(w, dtype, block_n=32)
        assert torch.equal(dense.cpu(), dequantize_w4(qweight.cpu(), scales.cpu(), qzeros.cpu(), gs, dtype))


def test_prepare_rejects_group_not_multiple_of_slice():
    qweight, scales, qzeros, gs, _ = make_weights(512, 16, 32, True, False, torch.float16)
    with pytest.raises(ValueError):
        prepare_w4a16(qweight, scales, qzeros, gs, pack_k=512)


@pytest.mark.parametrize("m,dtype,group_size,zeros,split_k", [
    (1, torch.float16, 128, True, 1),
    (1, torch.bfloat16, 32, False, 3),
    (3, torch.float16, -1, True, 2),
])
def test_gemv_matches_twin(m, dtype, group_size, zeros, split_k):
    k, n = 384, 100                                      # K not a multiple of pack_k, N not a multiple of 32
    qweight, scales, qzeros, gs, _ = make_weights(k, n, group_size, zeros, False, dtype, seed=m)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    bias = torch.randn(n, dtype=dtype, device=DEV)
    y = w4a16_forward(x, w, bias, W4A16Config("gemv", 1, 32, split_k))
    ref = reference(x, qweight, scales, qzeros, gs, None, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, ref) < TOL[dtype]
    cfg = W4A16Config("gemv", 1, 32, split_k, 4, 2, one_launch=True, pipeline=True)   # one counter per (row, tile)
    assert torch.equal(w4a16_forward(x, w, bias, cfg), y)


@pytest.mark.parametrize("m,dtype,group_size,zeros,act_order,block_m,split_k,path", [
    (5, torch.float16, 64, True, False, 16, 1, "gemm"),
    (7, torch.bfloat16, 128, True, True, 16, 4, "gemm"),
    (33, torch.float16, 32, False, True, 32, 2, "gemm"),
    (3, torch.float16, 128, True, False, 16, 2, "gemmt"),
])
def test_gemm_matches_twin(m, dtype, group_size, zeros, act_order, block_m, split_k, path):
    k, n = 256, 72
    qweight, scales, qzeros, gs, perm = make_weights(k, n, group_size, zeros, act_order, dtype, seed=m)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    y = w4a16_forward(x, w, None, W4A16Config(path, block_m, 32, split_k))
    ref = reference(x, qweight, scales, qzeros, gs, perm, None)
    assert rel_err(y, ref) < TOL[dtype]


def test_dequant_path_matches_twin():
    qweight, scales, qzeros, gs, perm = make_weights(256, 40, 128, True, True, torch.bfloat16)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    x = torch.randn(9, 256, dtype=torch.bfloat16, device=DEV)
    bias = torch.randn(40, dtype=torch.bfloat16, device=DEV)
    y = w4a16_forward(x, w, bias, W4A16Config("dequant"))
    assert rel_err(y, reference(x, qweight, scales, qzeros, gs, perm, bias)) < TOL[torch.bfloat16]


# single-launch split-K (ticket), the pipelined loop and narrow row steps: each must equal the two-launch, register-
# prefetch result bit for bit (same per-element sums in the same order), twice in a row (the counters reset).
@pytest.mark.parametrize("n,group_size,zeros,act_order,bias", [
    (100, 32, True, False, True),        # N not a multiple of the tile; groups slice a chunk
    (75, 64, False, True, False),        # odd N (no column permutation); act-order; symmetric
    (96, 128, True, True, True),
    (40, -1, True, False, True),
])
def test_gemv_variants_equal_baseline(n, group_size, zeros, act_order, bias):
    from quant_serve.kernels.matmul.splitk import tile_counters
    k = 384                                              # 3 chunks of 128, the last one padded
    qweight, scales, qzeros, gs, perm = make_weights(k, n, group_size, zeros, act_order, torch.float16, seed=n)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    x = torch.randn(1, k, dtype=torch.float16, device=DEV)
    b = torch.randn(n, dtype=torch.float16, device=DEV) if bias else None
    ref = reference(x, qweight, scales, qzeros, gs, perm, b)
    for split_k in (1, 3):
        base = w4a16_forward(x, w, b, W4A16Config("gemv", 1, 32, split_k))
        assert rel_err(base, ref) < TOL[torch.float16]
        for variant in (dict(one_launch=True), dict(pipeline=True, num_stages=2),
                        dict(one_launch=True, pipeline=True, num_stages=3),
                        dict(one_launch=True, rows=16, num_stages=3), dict(pipeline=True, rows=32, num_stages=4)):
            cfg = W4A16Config("gemv", 1, 64 if variant.get("rows") else 32, split_k, **variant)
            for _ in range(2):
                y = w4a16_forward(x, w, b, cfg)
                if variant.get("rows"):                  # another row blocking sums in another order
                    assert rel_err(y, ref) < TOL[torch.float16], cfg
                else:
                    assert torch.equal(y, base), cfg
    assert not tile_counters(x.device, 1).any()


@pytest.mark.parametrize("path,m", [("gemm", 5), ("gemmt", 3)])
def test_gemm_one_launch_equals_two_launch(path, m):
    from quant_serve.kernels.matmul.splitk import tile_counters
    k, n = 384, 72
    qweight, scales, qzeros, gs, perm = make_weights(k, n, 64, True, True, torch.float16, seed=m)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    b = torch.randn(n, dtype=torch.float16, device=DEV)
    base = w4a16_forward(x, w, b, W4A16Config(path, 16, 32, 3))
    assert rel_err(base, reference(x, qweight, scales, qzeros, gs, perm, b)) < TOL[torch.float16]
    for _ in range(2):
        assert torch.equal(w4a16_forward(x, w, b, W4A16Config(path, 16, 32, 3, one_launch=True)), base)
    assert not tile_counters(x.device, 1).any()


def test_gemv_rejects_rows_not_dividing_chunk():
    qweight, scales, qzeros, gs, _ = make_weights(256, 32, 128, True, False, torch.float16)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    with pytest.raises(ValueError):
        w4a16_forward(torch.randn(1, 256, dtype=torch.float16, device=DEV), w, None,
                      W4A16Config("gemv", 1, 32, 1, rows=48))


def test_dispatcher_cpu_uses_twin_on_both_layouts():
    qweight, scales, qzeros, gs, perm = make_weights(256, 48, 64, True, True, torch.float16, device="cpu")
    x = torch.randn(2, 3, 256, dtype=torch.float16)
    ref = w4a16_matmul_ref(x.reshape(6, 256), qweight, scales, qzeros, gs, perm).reshape(2, 3, 48)
    assert torch.equal(w4a16_matmul(x, qweight, scales, qzeros, gs, perm), ref)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    assert torch.equal(w4a16_matmul(x, w), ref)


# ---- GPU: real layer shapes, every path, through the dispatcher and with each path forced ----
QWEN_SHAPES = [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", QWEN_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_qwen_shapes_all_paths(k, n, dtype):
    qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, dtype, seed=k + n)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    dense = dequantize_w4(qweight, scales, qzeros, gs, torch.float32)                # on the GPU
    assert torch.equal(w4a16_dequantize(w, torch.float32), dense)
    if dtype == torch.float16:                       # the packed-half fast path rounds (q - z) * s once, like this
        assert torch.equal(w4a16_dequantize(w, torch.float16), dense.half())
    for m in (1, 4, 16, 64, 256, 1024):
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        ref = x.float() @ dense
        bm = 16 if m <= 16 else 64
        for cfg in (None, W4A16Config("gemv", 1, 128, 4), W4A16Config("gemm", bm, 128, 2),
                    W4A16Config("gemmt", bm, 128, 2, 4), W4A16Config("dequant"),
                    W4A16Config("gemv", 1, 64, 8, 4, 3, one_launch=True, pipeline=True),
                    W4A16Config("gemv", 1, 256, 4, 8, 3, one_launch=True, rows=16),
                    W4A16Config("gemmt", bm, 128, 2, 4, one_launch=True)):
            if cfg is not None and cfg.path == "gemv" and m > 16:
                continue
            y = w4a16_forward(x, w, None, cfg)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < TOL[dtype], (m, cfg, err)


@pytest.mark.gpu
def test_gpu_act_order_bias_sym():
    qweight, scales, qzeros, gs, perm = make_weights(4096, 1024, 128, False, True, torch.float16)
    w = prepare_w4a16(qweight, scales, qzeros, gs, perm)
    bias = torch.randn(1024, dtype=torch.float16, device="cuda")
    for m in (1, 13, 100, 3000):
        x = torch.randn(m, 4096, dtype=torch.float16, device="cuda")
        ref = reference(x, qweight, scales, qzeros, gs, perm, bias)
        assert rel_err(w4a16_matmul(x, w, bias=bias), ref) < TOL[torch.float16]
        assert rel_err(w4a16_matmul(x, qweight, scales, qzeros, gs, perm, bias), ref) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", QWEN_SHAPES)
def test_gpu_fast_gemv_variants_bitwise(k, n):
    """Fast path: single launch and the cp.async pipeline give the baseline's bits (same sums, same order)."""
    qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, torch.float16, seed=k + n)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    x = torch.randn(1, k, dtype=torch.float16, device="cuda")
    bias = torch.randn(n, dtype=torch.float16, device="cuda")
    for bn in (32, 64, 128):
        for split_k in (1, 2, 16):
            base = w4a16_forward(x, w, bias, W4A16Config("gemv", 1, bn, split_k))
            for ns in (2, 3, 4):
                for one in (False, True):
                    for _ in range(2):
                        cfg = W4A16Config("gemv", 1, bn, split_k, 4, ns, one_launch=one, pipeline=True)
                        assert torch.equal(w4a16_forward(x, w, bias, cfg), base), cfg
            cfg = W4A16Config("gemv", 1, bn, split_k, 4, 3, one_launch=True)
            assert torch.equal(w4a16_forward(x, w, bias, cfg), base), cfg
    ref = reference(x, qweight, scales, qzeros, gs, None, bias)
    y = w4a16_forward(x, w, bias, W4A16Config("gemv", 1, 256, 8, 8, 3, one_launch=True, pipeline=True, rows=16))
    assert rel_err(y, ref) < TOL[torch.float16]


@pytest.mark.gpu
def test_gpu_one_launch_in_cuda_graph():
    """Several single-launch split-K linears in one captured graph, replayed twice: the counters are allocated
    before capture and every kernel leaves its counters at 0 for the next."""
    from quant_serve.kernels.matmul.splitk import tile_counters
    layers = []
    for k, n in QWEN_SHAPES[:2] + [(512, 200)]:
        qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, torch.float16, seed=k)
        layers.append((prepare_w4a16(qweight, scales, qzeros, gs), torch.randn(1, k, dtype=torch.float16,
                                                                               device="cuda")))
    cfgs = [W4A16Config("gemv", 1, 64, 8, 4, 3, one_launch=True, pipeline=True),
            W4A16Config("gemv", 1, 32, 4, 4, 3, one_launch=True), W4A16Config("gemmt", 16, 64, 2, 4, one_launch=True)]
    eager = [[w4a16_forward(x, w, None, c) for c in cfgs] for w, x in layers]
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            outs = [[w4a16_forward(x, w, None, c) for c in cfgs] for w, x in layers]
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for ys, refs in zip(outs, eager):
            for y, r in zip(ys, refs):
                assert torch.equal(y, r)
    assert not tile_counters(torch.device("cuda"), 1).any()


@pytest.mark.parametrize("split_k,one_launch,bias", [(3, False, True), (3, False, False), (1, False, True),
                                                     (3, True, True)])
def test_gemv_silu_mul_equals_unfused(split_k, one_launch, bias):
    """gate | up -> silu(gate) * up: fused into the split-K reduce (two launches) or applied after (otherwise),
    bit-identical to the GEMV followed by the silu_and_mul kernel."""
    from quant_serve.kernels.norm_act import silu_and_mul_triton
    k, inter = 384, 48
    qweight, scales, qzeros, gs, _ = make_weights(k, 2 * inter, 128, True, False, torch.float16, seed=split_k)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    x = torch.randn(1, k, dtype=torch.float16, device=DEV)
    b = torch.randn(2 * inter, dtype=torch.float16, device=DEV) if bias else None
    cfg = W4A16Config("gemv", 1, 32, split_k, one_launch=one_launch)
    fused = w4a16_forward(x, w, b, cfg, silu_mul=True)
    assert fused.shape == (1, inter)
    unfused = silu_and_mul_triton(w4a16_forward(x, w, b, cfg))
    if split_k > 1 and not one_launch:                       # the reduce applied it: same formula, same roundings
        assert torch.equal(fused, unfused)
    else:
        torch.testing.assert_close(fused, unfused, atol=1e-3, rtol=1e-3)
    twin = w4a16_matmul(x.cpu(), qweight.cpu(), scales.cpu(), qzeros.cpu(), gs, bias=None if b is None else b.cpu(),
                        silu_mul=True)
    torch.testing.assert_close(fused.cpu().float(), twin.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_gate_up_silu_mul_fused_bitwise():
    """Qwen2.5-7B gate | up at M=1 with the dispatcher's config: the fused reduce gives the unfused bits."""
    from quant_serve.kernels.norm_act import silu_and_mul_triton
    qweight, scales, qzeros, gs, _ = make_weights(3584, 37888, 128, True, False, torch.float16, seed=7)
    w = prepare_w4a16(qweight, scales, qzeros, gs)
    for m in (1, 4, 64, 300):
        x = torch.randn(m, 3584, dtype=torch.float16, device="cuda")
        assert torch.equal(w4a16_forward(x, w, None, silu_mul=True), silu_and_mul_triton(w4a16_forward(x, w)))
