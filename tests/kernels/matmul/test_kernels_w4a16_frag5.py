"""GGUF Q5_K in the W4A16 fragment layout (kernels/matmul/frag/q5k.py): the packing round-trips on the CPU and every
weight's code comes out of an emulation of the kernel's LOP3s, the Gluon kernels compile for sm90 without spills
(offline) and on the GPU match the layout's fp16 reference and gguf's exact weights, and a CUDA fp16 W8Linear of
Q5_K shards takes the layout."""
import pytest
import torch

from quant_serve.kernels.matmul.frag.layout import ZP_Q5, frag_words
from quant_serve.kernels.matmul.frag.q5k import (frag5_bytes, frag5_codes, frag5_dequantize_ref, pack_frag5,
                                             pair_scales_offsets, q5k_pairs)
from quant_serve.kernels.matmul.frag.kquant import kquant_scales_offsets, pack_sub_codes, pack_superscales
from quant_serve.kernels.matmul.planes.q5k import pack_q5k, q5k_codes, q5k_dequantize

DEV = "cuda"


def q5k_layer(k: int, n: int, device: str = "cpu", seed: int = 0):
    """Random Q5_K weights as a file holds them (codes 0..31, 6-bit sub-scale and sub-min codes, fp16 d and dmin)
    -> Q5KWeights."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 32, (k, n), generator=gen)
    sub = pack_sub_codes(torch.randint(1, 64, (k // 32, n), generator=gen),
                         torch.randint(0, 64, (k // 32, n), generator=gen))
    d = (torch.rand(-(-k // 256), n, generator=gen) * 4e-5 + 1e-5).half()
    w = pack_q5k(codes, sub, pack_superscales(d, (d.float() * 16).half()))
    return w.to(device)


def frag5_of(w):
    return pack_frag5(q5k_codes(w), q5k_pairs(w.sub_codes, w.superscales))


@pytest.mark.parametrize("k,n", [(64, 16), (256, 48), (512, 32), (1024, 80)])
def test_pack_frag5_round_trips_codes_and_pairs(k, n):
    w = q5k_layer(k, n)
    fw = frag5_of(w)
    assert fw.zp_mode == ZP_Q5 and fw.group_size == 32
    assert torch.equal(frag5_codes(fw), q5k_codes(w).to(torch.int32))
    assert fw.words.shape == (n // 16, k // 64 * 128) and fw.hi.shape == (n // 16, k // 64 * 32)
    s, o = kquant_scales_offsets(w.sub_codes, w.superscales)
    s16, o16 = pair_scales_offsets(fw.scales)
    assert torch.equal(s16, s.half()) and torch.equal(o16, o.half())
    assert frag5_bytes(k, n) == fw.words.numel() * 4 + fw.hi.numel() * 4 + fw.scales.numel() * 4
    assert frag5_bytes(k, n) * 8 == k * n * 6
    # s and o rounded once to fp16, the weight once more: within fp16 of the exact weights
    ref = q5k_dequantize(w)
    assert (frag5_dequantize_ref(fw).float() - ref).abs().max() <= ref.abs().max() * 2 ** -9


def _lop3_codes(words: torch.Tensor, view: torch.Tensor) -> list[torch.Tensor]:
    """_Q5_DQ_ASM's LOP3 stage on the CPU: a word and its high-bit view -> the 5-bit code of each nibble j (the
    fp16 halves of a0..a3 decoded as the asm's sub / fma decode them)."""
    def halves(a):
        return [((a >> sh) & 0xFFFF).to(torch.int16).view(torch.float16).float() for sh in (0, 16)]
    c = 0x64006400
    out = {}
    for shift, (lo_j, hi_j) in ((0, (0, 4)), (8, (2, 6))):
        w = (words >> shift) & (0xFFFFFFFF >> shift)
        v = (view >> (shift // 4)) & (0xFFFFFFFF >> (shift // 4))
        a0 = (w & 0x000F000F) | (v & 0x00100010) | c
        a1 = (w & 0x00F000F0) | (v & 0x01000100) | c
        for j, val in zip((lo_j, hi_j), halves(a0)):
            out[j] = val - 1024
        for j, val in zip((lo_j + 1, hi_j + 1), halves(a1)):
            out[j] = val / 16 - 64
    return [out[j] for j in range(8)]


def test_every_code_comes_out_of_the_kernels_lop3s():
    """Emulating the asm on each word with its shifted / rotated high-bit view (_q5_by_word) gives every weight's
    5-bit code: the high bits sit where the masks read them and nowhere a neighbour's mask reads."""
    from quant_serve.kernels.matmul.frag.q6k import _rotr8
    codes = q5k_codes(q5k_layer(256, 32, seed=3)).to(torch.int32)
    fw = pack_frag5(codes, torch.zeros(8, 32, dtype=torch.int32))
    h = fw.hi.unsqueeze(-1)                                                       # [N/16, Kp/64 * 32, 1]
    shifted = (h >> 1) & 0x7FFFFFFF
    views = torch.cat([h, _rotr8(h), shifted, _rotr8(shifted)], dim=-1).view(fw.words.shape)   # kt = 0..3
    want = frag_words(codes & 0xF), frag_words(codes >> 4)
    for j, got in enumerate(_lop3_codes(fw.words.long() & 0xFFFFFFFF, views.long() & 0xFFFFFFFF)):
        expect = ((want[0] >> (4 * j)) & 0xF) + 16 * ((want[1] >> (4 * j)) & 1)
        assert torch.equal(got, expect.float()), j


def test_pack_frag5_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16 and K of 64"):
        pack_frag5(torch.zeros(64, 24, dtype=torch.int32), torch.zeros(2, 24, dtype=torch.int32))
    with pytest.raises(ValueError, match="pairs must be int32"):
        pack_frag5(torch.zeros(64, 16, dtype=torch.int32), torch.zeros(2, 16))


def test_cpu_q5k_layer_keeps_its_planes():
    from quant_serve.kernels.matmul.dispatch import prepare_q5k
    w = q5k_layer(256, 32)
    assert prepare_q5k(w, torch.float16) is w


def test_q5k_to_frag5_in_column_chunks_equals_one_pack():
    from quant_serve.kernels.matmul.dispatch import q5k_to_frag5
    w = q5k_layer(512, 80, seed=7)
    whole = frag5_of(w)
    chunked = q5k_to_frag5(w, max_elems=512 * 32)                          # 32 columns a chunk: 3 chunks
    for name in ("words", "hi", "scales"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert chunked.zp_mode == ZP_Q5 and chunked.group_size == 32


def compile_q5_cases() -> dict:
    """The Q5_K fragment kernels compiled for sm90 without a GPU, as the plan configures them (no register cap):
    M = 1 (qkv with x staged, long-K down, the SwiGLU gate_up), M = 16, wgmma at 32, the dequantize pass."""
    from quant_serve.kernels.matmul.frag.tiles import _frag_dequant_kernel
    from quant_serve.kernels.matmul.frag.mma import _w4a16_mma_kernel, mma_variant
    from quant_serve.kernels.matmul.plan import mma_config
    from kernel_helpers import compile_sm90, mma_signature
    sig = mma_signature("*i32", "*i32")
    out = {}
    for name, m, k, n, wg, silu in (("qkv-1", 1, 3584, 4608, False, False), ("down-1", 1, 18944, 3584, False, False),
                                    ("gate_up-1", 1, 3584, 37888, False, True), ("m16", 16, 3584, 4608, False, False),
                                    ("wgmma", 32, 3584, 4608, True, False)):
        cfg = mma_config(m, k, n, ZP_Q5, wg, silu)
        v = mma_variant(m, k, 32, cfg.block_n, cfg.block_k, cfg.split_k, wg, False)
        one = cfg.one_launch and v.splits > 1
        out[name] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=False, SPLIT=v.splits > 1, ONE_LAUNCH=one, GROUP=32, ZP_MODE=ZP_Q5, EVEN_N=True, EVEN_K=True,
            X_SMEM=m > 1 or wg, WGMMA=wg, PDL=True, SCALE_AFTER=False, X_STEPS=v.x_steps, SWIGLU=silu and one,
            A_SMEM=False, X_ONCE=v.x_once, PRELOAD=False, BLOCK_M=min(max(8, 1 << (m - 1).bit_length()), 64),
            BLOCK_N=cfg.block_n, BLOCK_K=v.block_k, num_warps=cfg.num_warps), cfg.num_warps, cfg.max_regs or None)
    sig = dict(w_ptr="*i32", s_ptr="*i32", z_ptr="*i32", out_ptr="*fp16", N="i32", K="i32", KP="i32",
               stride_sg="i32", stride_zg="i32")
    out["dequant"] = compile_sm90(_frag_dequant_kernel, sig, dict(GROUP=32, ZP_MODE=ZP_Q5, BLOCK_N=64, BLOCK_K=128,
                                                                    num_warps=4), 4)
    return out


def test_gluon_q5_kernels_compile_for_sm90_without_spills():
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_frag5", "compile_q5_cases")
    for name, r in res.items():
        assert r["stack"] == 0, (name, r)
        if name != "dequant":
            assert r["hgmma"] if name == "wgmma" else r["hmma"], (name, r)


def test_plan_takes_no_register_cap_for_q5k():
    from quant_serve.kernels.gpu import PROFILES
    from quant_serve.kernels.matmul.plan import plan_w4a16
    plan = plan_w4a16(1, 3584, 37888, PROFILES["h200"], silu_mul=True, zp_mode=ZP_Q5)
    assert plan.config.max_regs == 0 and "no register cap" in plan.why


# GPU: the Gluon kernels do not run in the interpreter
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU machine)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(256, 64), (512, 96), (3584, 512), (1024, 4608)])
@pytest.mark.parametrize("m", [1, 3, 16, 40, 64, 300])
def test_gpu_frag5_matmul_matches_reference(k, n, m):
    from quant_serve.kernels.matmul.dispatch import w4a16_matmul
    w = q5k_layer(k, n, DEV)
    fw = frag5_of(w)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    ref = x.float() @ frag5_dequantize_ref(fw).float()
    y = w4a16_matmul(x, fw).float()
    assert (y - ref).norm() / ref.norm() < 2e-3, (k, n, m)
    exact = x.float() @ q5k_dequantize(w)
    assert (y - exact).norm() / exact.norm() < 3e-3


@gpu
@pytest.mark.gpu
def test_gpu_frag5_kernels_every_config():
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    fw = frag5_of(q5k_layer(1024, 256, DEV, seed=3))
    assert torch.equal(frag_dequantize(fw).t(), frag5_dequantize_ref(fw))
    for m in (1, 8, 17):
        x = torch.randn(m, 1024, dtype=torch.float16, device=DEV)
        ref = x.float() @ frag5_dequantize_ref(fw).float()
        for cfg in (dict(), dict(block_n=64, block_k=128, split_k=4), dict(block_n=128, num_warps=8, split_k=2),
                    dict(split_k=2, one_launch=False), dict(block_n=64, block_k=128, split_k=2, wgmma=True),
                    dict(block_n=64, block_k=128, split_k=2, silu_mul=True)):
            y = w4a16_mma(x, fw, **cfg).float()
            want = ref
            if cfg.get("silu_mul"):
                want = torch.nn.functional.silu(ref[:, :128]) * ref[:, 128:]
            assert (y - want).norm() / want.norm() < 3e-3, (m, cfg)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["q5k", "q6k"])
def test_gpu_w8linear_takes_the_fragment_layout(kind):
    """A CUDA fp16 W8Linear of Q5_K / Q6_K shards converts its planes to the fragment layout at load (the probe
    passes on a GPU with tensor cores) and matches gguf's exact weights."""
    from quant_serve.kernels.matmul.frag.layout import ZP_Q6
    from quant_serve.kernels.matmul.frag.q6k import frag6_dequantize_ref
    from quant_serve.kernels.matmul.probes import frag5_works, frag6_works
    from quant_serve.kernels.matmul.planes.q6k import q6k_dequantize
    from quant_serve.quant.layers.w8 import W8Linear
    from kernel_helpers import q6k_layer
    assert (frag5_works if kind == "q5k" else frag6_works)(torch.device(DEV))
    lin = W8Linear(512, [96], False, torch.float16, DEV, None, 32 if kind == "q5k" else 16)
    if kind == "q5k":
        w, zp, exact_of, ref = q5k_layer(512, 96, DEV, seed=5), ZP_Q5, q5k_dequantize, frag5_dequantize_ref
        lin.q5k_planes = True
        lin._set_q5k(w)
    else:
        w, zp, exact_of, ref = q6k_layer(512, 96, DEV, seed=5), ZP_Q6, q6k_dequantize, frag6_dequantize_ref
        lin.q6k_planes = True
        lin._set_q6k(w)
    assert lin.frag is not None and lin.frag.zp_mode == zp and lin.superscales is lin.frag.hi
    x = torch.randn(2, 512, dtype=torch.float16, device=DEV)
    exact = x.float() @ exact_of(w)
    assert (lin(x).float() - exact).norm() / exact.norm() < 3e-3
    assert torch.allclose(lin.dequantized_weight(), ref(lin.frag).float().t())
