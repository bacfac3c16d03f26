"""W4A16 kernels with GGUF's float per-group offsets (W = q * s + o) against the torch twin: the row-layout Triton
kernels (gemv, gemm / gemmt, dequant) under TRITON_INTERPRET=1 on CPU (compiled on a GPU machine), the fragment
layout's Gluon kernels (mma.sync, wgmma, TMA, their dequantize pass, the folded norm) on the GPU only (`gpu` tests:
Gluon does not run in the interpreter), and the layout choice for an offset layer.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.gpu import PROFILES, KernelOptions  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.matmul.dispatch import (prepare_kernel_weights, standard_layout, w4a16_forward,  # noqa: E402
                                                w4a16_matmul)
from quant_serve.kernels.matmul.frag.layout import ZP_OFFSETS, FragWeights, prepare_frag  # noqa: E402
from quant_serve.kernels.matmul.frag.tiles import _frag_dq_asm  # noqa: E402
from quant_serve.kernels.matmul.plan import layout_for, plan_w4a16  # noqa: E402
from quant_serve.kernels.matmul.reference import dequantize_w4, pack_int4_rows, w4a16_matmul_ref  # noqa: E402
from quant_serve.kernels.matmul.rows.layout import W4A16Weights, prepare_w4a16  # noqa: E402
from quant_serve.kernels.matmul.rows.gemm import w4a16_dequantize  # noqa: E402
from quant_serve.kernels.matmul.rules import W4A16Config  # noqa: E402
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
    # a loader's fp32 scales and offsets (Q4_K) cast to the activation dtype at prepare
    w32 = prepare_kernel_weights(qweight.cpu(), scales.float().cpu(), None, 32, offsets=offsets.float().cpu(),
                                 scale_dtype=torch.float16)
    assert w32.scales.dtype == w32.offsets.dtype == torch.float16 and torch.equal(w4a16_matmul(x, w32), want)


def test_offsets_are_checked():
    qweight, scales, offsets = offset_weights(128, 32, 32, torch.float16)
    with pytest.raises(ValueError, match="not both"):
        prepare_w4a16(qweight, scales, torch.zeros(4, 4, dtype=torch.int32, device=DEV), 32, offsets=offsets)
    with pytest.raises(ValueError, match="scales' shape"):
        prepare_w4a16(qweight, scales, None, 32, offsets=offsets[:2])
    w = prepare_w4a16(qweight, scales, None, 32, offsets=offsets.float())
    assert w.offsets.dtype == torch.float16          # cast to the scales' dtype, as the kernels read them


@pytest.mark.parametrize("caps", [PROFILES["h200"], PROFILES["a10"]])
def test_offset_layers_take_the_fragment_layout_unless_its_probe_failed(caps):
    """Every kernel of both layouts takes offsets, so an offset layer is laid out as a zero-point one; where the
    device's offset probe of the fragment kernels failed, it goes to the row layout, whose plans name row-layout
    kernels only (all of which take offsets)."""
    for k, n, gs in [(3584, 4608, 32), (18944, 3584, 32), (3584, 37888, 32), (256, 64, 16)]:
        assert layout_for(k, n, gs, torch.float16, caps, KernelOptions(), offsets=True)[0] == "frag"
        layout, why = layout_for(k, n, gs, torch.float16, caps, KernelOptions(), offsets=True, frag_offsets=False)
        assert layout == "rows" and "probe" in why
        assert layout_for(k, n, gs, torch.float16, caps, KernelOptions(), frag_offsets=False)[0] == "frag"
        for m in (1, 4, 16, 17, 64, 128, 4096):
            for silu_mul in (False, True):
                plan = plan_w4a16(m, k, n, caps, KernelOptions(), layout, torch.float16, silu_mul)
                assert plan.kernel in ("gemv", "gemm", "gemmt", "dequant+cublas"), plan


def test_prepare_frag_keeps_offsets_and_the_twin_reads_them():
    qweight, scales, offsets = offset_weights(192, 48, 32, torch.float16)
    fw = prepare_frag(qweight.cpu(), scales.cpu(), None, 32, offsets=offsets.float().cpu())
    assert fw.offsets.dtype == torch.float16 and fw.zp_mode == ZP_OFFSETS
    assert fw.zero_args()[0] is fw.offsets and fw.zero_args()[1] == 48
    x = torch.randn(2, 192, dtype=torch.float16)
    want = w4a16_matmul_ref(x, qweight.cpu(), scales.cpu(), None, 32, offsets=offsets.cpu())
    assert torch.equal(w4a16_matmul(x, fw), want)
    with pytest.raises(ValueError, match="not both"):
        prepare_frag(qweight.cpu(), scales.cpu(), torch.zeros(6, 6, dtype=torch.int32), 32, offsets=offsets.cpu())


def test_frag_offset_asm_differs_from_the_zero_point_one_only_in_the_dequant():
    """The zero-point asm is unchanged; the offset one subtracts the constants (z = 0) and fuses o into the scale
    step (fma), so both run 13 lane instructions per 8 weights plus two constant moves."""
    plain, offs = _frag_dq_asm(True), _frag_dq_asm(True, offsets=True)
    assert plain.count("mul.rn.f16x2") == 4 and "fma.rn.f16x2 a0, a0, $9" not in plain
    assert offs.count("fma.rn.f16x2") == 6 and "mul.rn.f16x2" not in offs
    assert "sub.rn.f16x2 a0, a0, c1024" in offs and "fma.rn.f16x2 a1, a1, $10, $12" in offs


# GPU: the Gluon fragment-layout kernels (they do not run in the interpreter) with offsets against the twin


def gpu_frag_case(k, n, gs, m):
    qweight, scales, offsets = offset_weights(k, n, gs, torch.float16, seed=m)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    bias = torch.randn(n, dtype=torch.float16, device=DEV)
    fw = prepare_frag(qweight, scales, None, gs, offsets=offsets)
    return fw, x, bias, reference(x, qweight, scales, offsets, gs, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,gs", [(512, 256, 32), (384, 160, 16), (3584, 4608, 32), (256, 128, 128)])
@pytest.mark.parametrize("m", [1, 4, 17, 64])
def test_gpu_mma_and_wgmma_with_offsets_match_twin(k, n, gs, m):
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    fw, x, bias, ref = gpu_frag_case(k, n, gs, m)
    for cfg in (dict(), dict(block_n=64, block_k=128, split_k=3), dict(block_n=64, block_k=128, split_k=2,
                one_launch=False), dict(block_n=64, block_k=128, split_k=2, wgmma=True),
                dict(block_n=128, block_k=128, num_warps=8, split_k=2, one_launch=False, wgmma=True),
                dict(block_n=64, block_k=128, split_k=2, wgmma=True, a_smem=True)):
        assert rel_err(w4a16_mma(x, fw, bias, **cfg), ref) < 2e-3, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 64, 300])
def test_gpu_tma_dequant_and_planned_path_with_offsets_match_twin(m):
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    k, n, gs = 512, 256, 32
    fw, x, bias, ref = gpu_frag_case(k, n, gs, m)
    if torch.cuda.get_device_capability() == (9, 0):
        for cfg in (dict(block_n=64, consumers=1), dict(block_n=128, consumers=2),
                    dict(block_n=128, consumers=1, overlap=True), dict(block_n=64, consumers=1, block_k=128)):
            assert rel_err(w4a16_tma(x, fw, bias, **cfg), ref) < 2e-3, cfg
    qweight, scales, offsets = offset_weights(k, n, gs, torch.float16, seed=m)
    dense = dequantize_w4(qweight.cpu(), scales.cpu(), None, gs, torch.float32, offsets.cpu())
    assert rel_err(frag_dequantize(fw).t(), dense) < 1e-3
    w = prepare_kernel_weights(qweight, scales, None, gs, offsets=offsets)   # the probe, then the planned kernel
    assert isinstance(w, FragWeights) and w.offsets is not None
    assert rel_err(w4a16_forward(x, w, bias), ref) < 2e-3


@pytest.mark.gpu
def test_gpu_folded_norm_and_swiglu_with_offsets_match_unfused():
    from quant_serve.kernels.matmul.frag.fold import FoldedNorm, folded_norm_applies, w4a16_normed, w4a16_residual
    k, n, gs = 512, 512, 32
    fw, x, _, _ = gpu_frag_case(k, n, gs, 1)
    assert folded_norm_applies(fw)
    residual = torch.randn(1, n, dtype=torch.float16, device=DEV)
    h, ss = w4a16_residual(x, fw, residual)
    assert rel_err(h, reference(x, *standard_offsets(fw)) + residual.cpu().float()) < 2e-3
    assert torch.allclose(ss.sum(), h.float().pow(2).sum(), rtol=1e-5)          # sums of the rounded h
    weight = torch.rand(k, dtype=torch.float16, device=DEV) + 0.5
    y = w4a16_normed(h, fw, FoldedNorm(ss, weight, 1e-6), silu_mul=True)
    hn = weight * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)
    r = reference(hn, *standard_offsets(fw))
    assert rel_err(y, torch.nn.functional.silu(r[:, : n // 2]) * r[:, n // 2:]) < 5e-3


def standard_offsets(fw):
    """(qweight, scales, offsets, group_size) of a FragWeights, for reference()."""
    qweight, scales, _, gs = standard_layout(fw)
    return qweight, scales, fw.offsets, gs


def compile_offset_cases() -> dict:
    """The fragment kernels with float offsets (ZP_MODE 2, GGUF's groups of 32) compiled for sm90 without a GPU:
    the batch-1 decode configurations of qkv (x staged) and down (long K), M = 16, wgmma at M = 32, the folded
    residual epilogue and the dequantize pass."""
    from quant_serve.kernels.matmul.frag.tiles import _frag_dequant_kernel
    from quant_serve.kernels.matmul.frag.mma import _w4a16_mma_kernel, mma_variant
    from quant_serve.kernels.matmul.rules import select_mma_config
    from kernel_helpers import compile_sm90, mma_signature
    sig = mma_signature("*fp16", "*fp16")
    out = {}
    for name, m, k, n, wgmma, residual in (("qkv-1", 1, 3584, 4608, False, False),
                                           ("down-1", 1, 18944, 3584, False, False),
                                           ("qkv-16", 16, 3584, 4608, False, False),
                                           ("wgmma-32", 32, 3584, 4608, True, False),
                                           ("residual-o-1", 1, 3584, 3584, False, True)):
        cfg = select_mma_config(m, k, n, wgmma)
        v = mma_variant(m, k, 32, cfg.block_n, cfg.block_k, cfg.split_k, wgmma, scale_after=False)
        out[name] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=False, SPLIT=v.splits > 1, ONE_LAUNCH=cfg.one_launch, GROUP=32, ZP_MODE=2, EVEN_N=True,
            EVEN_K=True, X_SMEM=m > 1 or wgmma, WGMMA=wgmma, PDL=True, SCALE_AFTER=False, X_STEPS=v.x_steps,
            SWIGLU=False, A_SMEM=False, X_ONCE=v.x_once, PRELOAD=False,       # w4a16_mma: none below a step's group
            RESIDUAL=residual, SS_P2=64, BLOCK_M=min(max(8, 1 << (m - 1).bit_length()), 64),
            BLOCK_N=cfg.block_n, BLOCK_K=v.block_k, num_warps=cfg.num_warps), cfg.num_warps)
    sig = dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*fp16", out_ptr="*fp16", N="i32", K="i32", KP="i32",
               stride_sg="i32", stride_zg="i32")
    out["dequant"] = compile_sm90(_frag_dequant_kernel, sig, dict(GROUP=32, ZP_MODE=2, BLOCK_N=64, BLOCK_K=128,
                                                                    num_warps=4), 4)
    return out


def test_gluon_offset_kernels_compile_for_sm90_without_spills():
    """Offline (the wheel's ptxas, no GPU): the offset asm assembles, the dequantized words stay the MMA's A operand
    (the trivial-layout assertion), tensor-core MMAs, no spills."""
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_offsets", "compile_offset_cases")
    for name in ("qkv-1", "down-1", "qkv-16", "residual-o-1"):
        assert res[name]["hmma"] and res[name]["stack"] == 0, (name, res[name])
    # M = 1 without the PDL preload at groups of 32 (78 registers with Triton 3.9; 185 with it)
    assert res["qkv-1"]["regs"] <= 96, res["qkv-1"]
    assert res["wgmma-32"]["hgmma"] and res["wgmma-32"]["stack"] == 0, res["wgmma-32"]
    assert res["dequant"]["stack"] == 0 and res["dequant"]["stg128"], res["dequant"]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (3584, 37888)])
def test_gpu_planned_offsets_on_qwen_shapes(k, n):
    """Each kernel the plan picks for a GGUF layer of the Qwen2.5-7B shapes (mma.sync, wgmma / TMA on sm90,
    dequantize + cuBLAS) with offsets, and the SwiGLU where gate_up has it, against the twin."""
    qweight, scales, offsets = offset_weights(k, n, 32, torch.float16)
    w = prepare_kernel_weights(qweight, scales, None, 32, offsets=offsets)
    dense = dequantize_w4(qweight, scales, None, 32, torch.float32, offsets)            # [K, N] fp32, on the GPU
    for m in (1, 4, 16, 17, 64, 256, 5000):
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        ref = (x.float() @ dense).cpu()
        assert rel_err(w4a16_forward(x, w), ref) < 2e-3, m
        if n == 37888 and m <= 16:
            want = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2:]
            assert rel_err(w4a16_forward(x, w, silu_mul=True), want) < 5e-3, m
