"""GGUF Q4_K kept two-level in the W4A16 kernels (kernels/matmul/frag/kquant.py): int16 sub-codes and int32 super-scales
read by the row-layout Triton kernels (gemv, gemm / gemmt, dequantize pass) under TRITON_INTERPRET=1 on CPU (compiled
on a GPU), against gguf.quants.dequantize (bit-exact dequant) and a torch matmul over it; the fragment layout's Gluon
kernels with the same tensors on the GPU only (`gpu` tests: Gluon does not run in the interpreter)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from gguf import GGMLQuantizationType as T  # noqa: E402

from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.triton_compat import interpreting  # noqa: E402
from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights, twin_args, w4a16_forward, w4a16_matmul  # noqa: E402,E501
from quant_serve.kernels.matmul.frag.layout import ZP_KQUANT, prepare_frag  # noqa: E402
from quant_serve.kernels.matmul.frag.kquant import kquant_bytes, kquant_scales_offsets  # noqa: E402
from quant_serve.kernels.matmul.rows.layout import prepare_w4a16  # noqa: E402
from quant_serve.kernels.matmul.rows.gemm import w4a16_dequantize  # noqa: E402
from quant_serve.kernels.matmul.rules import W4A16Config  # noqa: E402
from quant_serve.quant.formats.gguf.types import read_grouped  # noqa: E402
from kernel_helpers import q4_k_layer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(y, ref):
    return ((y.cpu().float() - ref).norm() / ref.norm()).item()


def test_two_level_scales_are_gguf_products_and_fewer_bytes():
    raw, dense, qweight, sub, sup = q4_k_layer(512, 48)
    assert sub.dtype == torch.int16 and sub.shape == (16, 48) and sup.dtype == torch.int32 and sup.shape == (2, 48)
    scales, offsets = kquant_scales_offsets(sub.cpu(), sup.cpu())
    g = read_grouped(raw, T.Q4_K, 48, 512)                      # today's fp32 products: the same numbers
    assert torch.equal(scales, g.scales.t()) and torch.equal(offsets, g.offsets.t())
    # 4.625 bits a weight: 4 + 16 / 32 + 32 / 256, the file's 4.5 plus one byte a sub-block for unpacked 6-bit codes
    assert kquant_bytes(512, 48) * 8 == 512 * 48 * 4.625
    held = qweight.numel() * 4 + sub.numel() * 2 + sup.numel() * 4
    assert held == kquant_bytes(512, 48)


@pytest.mark.parametrize("k,n,pack_k", [(512, 72, 128), (768, 40, 256)])
def test_dequantize_pass_is_bit_exact_vs_gguf(k, n, pack_k):
    _, dense, qweight, sub, sup = q4_k_layer(k, n, seed=k)
    w = prepare_w4a16(qweight, sub, None, 32, pack_k=pack_k, superscales=sup)
    assert w.offset_mode == 2
    got = w4a16_dequantize(w, torch.float32, block_n=32).cpu()
    if interpreting():               # fp32 q * s then + o, as numpy; compiled, one fma may round once
        assert torch.equal(got, dense)
    else:
        assert torch.allclose(got, dense, rtol=1e-6, atol=1e-7)
    assert torch.equal(w4a16_dequantize(w, torch.float16, block_n=32).cpu(), got.half()) or not interpreting()


@pytest.mark.parametrize("m,dtype,split_k,variant", [
    (1, torch.float16, 1, {}),
    (1, torch.bfloat16, 3, dict(one_launch=True, pipeline=True)),
    (3, torch.float16, 2, dict(rows=32)),
])
def test_gemv_matches_gguf_matmul(m, dtype, split_k, variant):
    k, n = 768, 100                                   # K = 6 chunks of 128, N not a multiple of the tile
    _, dense, qweight, sub, sup = q4_k_layer(k, n, seed=m)
    w = prepare_w4a16(qweight, sub, None, 32, superscales=sup)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    bias = torch.randn(n, dtype=dtype, device=DEV)
    y = w4a16_forward(x, w, bias, W4A16Config("gemv", 1, 32, split_k, 4, 2, **variant))
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, x.cpu().float() @ dense + bias.cpu().float()) < TOL[dtype]


@pytest.mark.parametrize("m,dtype,block_m,split_k,path", [
    (4, torch.float16, 16, 2, "gemmt"),
    (17, torch.bfloat16, 32, 1, "gemm"),
])
def test_gemm_and_dequant_paths_match_gguf_matmul(m, dtype, block_m, split_k, path):
    k, n = 512, 64
    _, dense, qweight, sub, sup = q4_k_layer(k, n, seed=10 + m)
    w = prepare_w4a16(qweight, sub, None, 32, superscales=sup)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    ref = x.cpu().float() @ dense
    assert rel_err(w4a16_forward(x, w, None, W4A16Config(path, block_m, 32, split_k)), ref) < TOL[dtype]
    assert rel_err(w4a16_forward(x, w, None, W4A16Config("dequant")), ref) < TOL[dtype]


def test_cpu_twin_and_prepare_checks():
    _, dense, qweight, sub, sup = q4_k_layer(256, 32)
    qweight, sub, sup = qweight.cpu(), sub.cpu(), sup.cpu()
    w = prepare_kernel_weights(qweight, sub, None, 32, superscales=sup, scale_dtype=torch.float16)
    assert w.superscales is not None and w.scales.dtype == torch.int16      # nothing cast
    x = torch.randn(2, 256, dtype=torch.float16)
    assert rel_err(w4a16_matmul(x, w), x.float() @ dense) < 2e-3
    fw = prepare_frag(qweight, sub, None, 32, superscales=sup)
    assert fw.zp_mode == ZP_KQUANT and fw.zero_args()[0] is fw.superscales
    assert torch.equal(w4a16_matmul(x, fw), w4a16_matmul(x, w))
    _, scales, _, _, _, offsets = twin_args(fw)
    assert torch.equal(scales, kquant_scales_offsets(sub, sup)[0]) and offsets.dtype == torch.float32
    with pytest.raises(ValueError, match="super-scales"):
        prepare_w4a16(qweight, sub, None, 32, superscales=sup[:, :16])
    with pytest.raises(ValueError, match="int16"):
        prepare_w4a16(qweight, sub.float(), None, 32, superscales=sup)
    with pytest.raises(ValueError, match="own offsets"):
        prepare_w4a16(qweight, sub, None, 32, offsets=sub.float(), superscales=sup)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (512, 256)])
def test_gpu_planned_kquant_matches_gguf(k, n):
    """Each kernel the plan picks (mma.sync, wgmma / TMA on sm90, dequantize + cuBLAS) with k-quant scales."""
    _, dense, qweight, sub, sup = q4_k_layer(k, n)
    w = prepare_kernel_weights(qweight, sub, None, 32, superscales=sup, scale_dtype=torch.float16)
    for m in (1, 4, 16, 17, 64, 256, 3000):
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        assert rel_err(w4a16_forward(x, w), x.cpu().float() @ dense) < 2e-3, m
    rows = prepare_w4a16(qweight, sub, None, 32, superscales=sup)
    assert torch.equal(w4a16_dequantize(rows, torch.float32).cpu(), dense) or \
        torch.allclose(w4a16_dequantize(rows, torch.float32).cpu(), dense, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_gpu_kquant_probe_passes_where_the_kernels_are_right():
    """The load-time probe (kernels/matmul/plan.py) must accept the fragment kernels with k-quant scales on sm80+:
    a probe that expects the wrong value sends every Q4_K layer to the row-layout kernels (8x slower on the H200)."""
    from quant_serve.kernels.matmul.probes import _frag_offsets_work
    from quant_serve.kernels.matmul.probes import frag_offsets_work
    _frag_offsets_work.cache_clear()
    assert frag_offsets_work(torch.device(DEV), kquant=True)
    assert frag_offsets_work(torch.device(DEV), kquant=False)


def compile_kquant_cases() -> dict:
    """The fragment kernels with k-quant scales (ZP_MODE 3: int16 sub-codes, int32 super-scales, groups of 32)
    compiled for sm90 without a GPU: mma.sync at M = 1 (qkv, long-K down) and 16, wgmma at 32, the folded residual
    epilogue, the dequantize pass and a TMA tile (M = 17..4096 on sm90)."""
    from triton.experimental.gluon import language as gl

    from quant_serve.kernels.matmul.frag.tiles import _frag_dequant_kernel
    from quant_serve.kernels.matmul.frag.mma import _w4a16_mma_kernel, mma_variant
    from quant_serve.kernels.matmul.rules import select_mma_config
    from quant_serve.kernels.matmul.frag.tma import _w4a16_tma_kernel, register_budget
    from kernel_helpers import compile_sm90, mma_signature
    sig = mma_signature("*i16", "*i32")
    out = {}
    for name, m, k, n, wgmma, residual in (("qkv-1", 1, 3584, 4608, False, False),
                                           ("down-1", 1, 18944, 3584, False, False),
                                           ("qkv-16", 16, 3584, 4608, False, False),
                                           ("wgmma-32", 32, 3584, 4608, True, False),
                                           ("residual-o-1", 1, 3584, 3584, False, True)):
        cfg = select_mma_config(m, k, n, wgmma)
        v = mma_variant(m, k, 32, cfg.block_n, cfg.block_k, cfg.split_k, wgmma, scale_after=False)
        out[name] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=False, SPLIT=v.splits > 1, ONE_LAUNCH=cfg.one_launch, GROUP=32, ZP_MODE=3, EVEN_N=True,
            EVEN_K=True, X_SMEM=m > 1 or wgmma, WGMMA=wgmma, PDL=True, SCALE_AFTER=False, X_STEPS=v.x_steps,
            SWIGLU=False, A_SMEM=False, X_ONCE=v.x_once, PRELOAD=False, RESIDUAL=residual, SS_P2=64,
            BLOCK_M=min(max(8, 1 << (m - 1).bit_length()), 64), BLOCK_N=cfg.block_n, BLOCK_K=v.block_k,
            num_warps=cfg.num_warps), cfg.num_warps)
    sig = dict(w_ptr="*i32", s_ptr="*i16", z_ptr="*i32", out_ptr="*fp16", N="i32", K="i32", KP="i32",
               stride_sg="i32", stride_zg="i32")
    out["dequant"] = compile_sm90(_frag_dequant_kernel, sig, dict(GROUP=32, ZP_MODE=3, BLOCK_N=64, BLOCK_K=128,
                                                                    num_warps=4), 4)
    consumer_regs, producer_regs, maxnreg = register_budget(1)
    wl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xl = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    sig = dict(w_desc=f"tensordesc<i32[4, 128],{wl!r}>", x_desc=f"tensordesc<fp16[64, 64],{xl!r}>",
               s_ptr="*i16", z_ptr="*i32", out_ptr="*fp16", ws_ptr="*fp32", bias_ptr="*fp16",
               **{a: "i32" for a in ("M", "N", "KP", "m_tiles", "waves", "tail", "p_sk", "max_segs", "stride_om",
                                     "stride_sg", "stride_zg")})
    out["tma"] = compile_sm90(_w4a16_tma_kernel, sig, dict(
        HAS_BIAS=False, GROUP=32, ZP_MODE=3, EVEN_N=True, PDL=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, STAGES=4,
        CONSUMERS=1, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, OVERLAP=False), 4, maxnreg)
    return out


def test_gluon_kquant_kernels_compile_for_sm90_without_spills():
    """Offline (the wheel's ptxas, no GPU): the k-quant mode of every fragment kernel the plan can pick compiles,
    its dequantized words stay the MMA's A operand (the trivial-layout assertion), tensor-core MMAs, no spills."""
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_kquant", "compile_kquant_cases")
    for name in ("qkv-1", "down-1", "qkv-16", "residual-o-1"):
        assert res[name]["hmma"] and res[name]["stack"] == 0, (name, res[name])
    assert res["wgmma-32"]["hgmma"] and res["wgmma-32"]["stack"] == 0, res["wgmma-32"]
    assert res["dequant"]["stack"] == 0, res["dequant"]
    assert res["tma"]["hgmma"] and res["tma"]["stack"] == 0, res["tma"]
    print({name: r["regs"] for name, r in res.items()})
