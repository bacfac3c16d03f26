"""The warp-specialized Hopper W4A16 kernel (kernels/w4a16_ws.py): exact against the dequantized reference on the
GPU machine (sm90 only), and compiled for sm90 here."""
import pytest
import torch

from kernels.w4a16_frag import prepare_frag
from tests.test_kernels_w4a16 import make_weights, reference, rel_err
from tests.test_kernels_w4a16_mma import compiled_in_fresh_process, frag_case

DEV = "cuda"


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="warp specialization with wgmma needs an sm90 GPU")


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,n,group_size,zeros", [(512, 256, 128, True), (384, 192, 64, False),
                                                  (320, 128, 32, True), (200, 80, -1, True), (3584, 1024, 128, True)])
@pytest.mark.parametrize("m", [1, 17, 64, 100, 128, 300])
def test_gpu_ws_matches_twin(k, n, group_size, zeros, m):
    from kernels.w4a16_ws import w4a16_ws
    fw, x, bias, ref = frag_case(k, n, group_size, zeros, m)
    for cfg in (dict(), dict(block_n=64, block_k=128), dict(split_k=3), dict(block_m=16, stages=2, prefetch=0),
                dict(block_m=64, block_k=64, stages=3, split_k=2, prefetch=2)):
        assert rel_err(w4a16_ws(x, fw, bias, **cfg), ref) < 2e-3, cfg


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
def test_gpu_ws_silu_mul_and_strided_x():
    from kernels.norm_act import silu_and_mul
    from kernels.w4a16_ws import w4a16_ws
    qweight, scales, qzeros, gs, _ = make_weights(512, 256, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    x = torch.randn(512, 40, dtype=torch.float16, device=DEV).t()              # transposed: copied first
    ref = reference(x.contiguous(), qweight, scales, qzeros, gs, None, None)
    assert rel_err(w4a16_ws(x, fw), ref) < 2e-3
    for split in (1, 2):
        fused = w4a16_ws(x, fw, split_k=split, silu_mul=True)
        assert rel_err(fused, silu_and_mul(ref.to(torch.float16).to(DEV)).float().cpu()) < 5e-3


def compile_ws_cases() -> dict:
    """The kernel's tiles at the default register split, compiled for sm90 (a fresh process: see the caller)."""
    from tests.test_kernels_w4a16_mma import _compile_sm90
    from kernels.w4a16_ws import _w4a16_ws_kernel, register_split
    sig = dict(x_ptr="*fp16", w_ptr="*i32", s_ptr="*fp16", z_ptr="*i32", out_ptr="*fp16", ws_ptr="*fp32",
               bias_ptr="*fp16", **{a: "i32" for a in ("M", "N", "KP", "stride_xm", "stride_om", "stride_sg",
                                                       "stride_zg", "iters_per_split")})
    out = {}
    for bm, bn, bk, stages, split in [(16, 128, 64, 4, False), (64, 128, 64, 4, True), (128, 128, 64, 4, False),
                                      (64, 64, 128, 4, False)]:
        regs, maxnreg = register_split(bm)
        out[f"{bm}-{bn}-{bk}-{stages}"] = _compile_sm90(_w4a16_ws_kernel, sig, dict(
            HAS_BIAS=not split, SPLIT=split, GROUP=128, HAS_ZEROS=True, EVEN_N=True, PDL=True, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, PRODUCER_REGS=regs, PREFETCH=6, num_warps=4), 4, maxnreg)
    return out


def test_ws_kernel_compiles_for_sm90_without_spills():
    """Two partitions with their own register budgets (setmaxnreg), the dequantized tile stored by stmatrix, wgmma
    from shared memory, the L2 prefetches of steps ahead, no spills: checked on any machine with the wheel's
    ptxas."""
    res = compiled_in_fresh_process("tests.test_kernels_w4a16_ws", "compile_ws_cases")
    for name, r in res.items():
        assert r["hgmma"] and r["stsm"] and r["setmaxnreg"] and r["l2_prefetch"] and r["stack"] == 0, (name, r)
