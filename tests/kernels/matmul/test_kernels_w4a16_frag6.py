"""GGUF Q6_K in the W4A16 fragment layout (kernels/matmul/frag/q6k.py): the packing round-trips on the CPU, the Gluon
kernels (GPU only) match the layout's fp16 reference and the bit-exact planes within fp16 rounding, and a CUDA fp16
W8Linear of Q6_K shards takes the layout."""
import pytest
import torch

from quant_serve.kernels.matmul.frag.layout import ZP_Q6
from quant_serve.kernels.matmul.frag.q6k import frag6_bytes, frag6_codes, frag6_dequantize_ref, pack_frag6
from quant_serve.kernels.matmul.planes.q6k import q6k_codes, q6k_dequantize, q6k_scales
from kernel_helpers import q6k_layer

DEV = "cuda"


@pytest.mark.parametrize("k,n", [(64, 16), (256, 48), (320, 32), (1024, 80)])
def test_pack_frag6_round_trips_codes_and_scales(k, n):
    w = q6k_layer(k, n)
    fw = pack_frag6(q6k_codes(w), q6k_scales(w))
    assert fw.zp_mode == ZP_Q6 and fw.group_size == 16
    assert torch.equal(frag6_codes(fw), q6k_codes(w))
    kp = -(-k // 64) * 64
    assert fw.words.shape == (n // 16, kp // 64 * 128) and fw.hi.shape == (n // 16, kp // 64 * 64)
    assert torch.equal(fw.scales[: k // 16], q6k_scales(w).half())
    assert frag6_bytes(k, n) == fw.words.numel() * 4 + fw.hi.numel() * 4 + fw.scales.numel() * 2
    # one fp16 rounding of d * sc and one of the product: within fp16 of the exact weights
    ref = q6k_dequantize(w)
    assert (frag6_dequantize_ref(fw).float() - ref).abs().max() <= ref.abs().max() * 2 ** -10


def test_pack_frag6_puts_each_high_bit_pair_where_the_kernel_reads_it():
    """One weight at a time: its 2 high bits land in the one hi bit pair the kernel's masks take for its nibble."""
    from quant_serve.kernels.matmul.frag.layout import frag_words
    from quant_serve.kernels.matmul.frag.q6k import _HI_MASK, _HI_POS, _rotr8
    for k in (0, 1, 8, 9, 16, 17, 24, 25, 33, 63):
        codes = torch.full((64, 16), -32)
        codes[k, 3] = 48 - 32                                                  # u = 48: lo 0, hi 3
        fw = pack_frag6(codes, torch.ones(4, 16))
        one = torch.zeros(64, 16, dtype=torch.int32)
        one[k, 3] = 1
        marked = frag_words(one)
        (tile, word), = torch.nonzero(marked).tolist()
        j = (int(marked[tile, word]).bit_length() - 1) // 4                  # the weight's nibble in its word
        h = fw.hi[tile, word // 2]
        bits = int(h) & _HI_MASK if word % 2 == 0 else int(_rotr8(h)) & _HI_MASK
        assert bits == 3 << _HI_POS[j], (k, j, hex(bits))


def test_pack_frag6_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiples of 16"):
        pack_frag6(torch.zeros(64, 24, dtype=torch.int32), torch.ones(4, 24))
    with pytest.raises(ValueError, match="scales must be"):
        pack_frag6(torch.zeros(64, 16, dtype=torch.int32), torch.ones(3, 16))


def test_cpu_q6k_layer_keeps_its_planes():
    from quant_serve.kernels.matmul.dispatch import prepare_q6k
    w = q6k_layer(256, 32)
    assert prepare_q6k(w, torch.float16) is w


def test_q6k_to_frag6_in_column_chunks_equals_one_pack():
    """The load-time conversion (column chunks, as a 152k-row head takes) joins its chunks into the layout one pack
    of the whole matrix gives: every code and scale where the kernels read it."""
    from quant_serve.kernels.matmul.dispatch import q6k_to_frag6
    w = q6k_layer(320, 80, seed=7)
    whole = pack_frag6(q6k_codes(w), q6k_scales(w))
    chunked = q6k_to_frag6(w, max_elems=320 * 32)                          # 32 columns a chunk: 3 chunks
    for name in ("words", "hi", "scales"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert torch.equal(frag6_codes(chunked), q6k_codes(w)) and chunked.zp_mode == ZP_Q6


# GPU: the Gluon kernels do not run in the interpreter
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the GPU machine)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(256, 64), (320, 96), (3584, 512), (1024, 4608)])
@pytest.mark.parametrize("m", [1, 3, 16, 40, 64, 300])
def test_gpu_frag6_matmul_matches_reference(k, n, m):
    from quant_serve.kernels.matmul.dispatch import w4a16_matmul
    w = q6k_layer(k, n, DEV)
    fw = pack_frag6(q6k_codes(w), q6k_scales(w))
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    ref = x.float() @ frag6_dequantize_ref(fw).float()
    y = w4a16_matmul(x, fw).float()
    assert (y - ref).norm() / ref.norm() < 2e-3, (k, n, m)
    exact = x.float() @ q6k_dequantize(w)
    assert (y - exact).norm() / exact.norm() < 3e-3


@gpu
@pytest.mark.gpu
def test_gpu_frag6_kernels_every_config():
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    w = q6k_layer(1024, 256, DEV, seed=3)
    fw = pack_frag6(q6k_codes(w), q6k_scales(w))
    assert torch.equal(frag_dequantize(fw).t(), frag6_dequantize_ref(fw))
    for m in (1, 8, 17):
        x = torch.randn(m, 1024, dtype=torch.float16, device=DEV)
        ref = x.float() @ frag6_dequantize_ref(fw).float()
        for cfg in (dict(), dict(block_n=64, block_k=128, split_k=4), dict(block_n=128, num_warps=8, split_k=2),
                    dict(split_k=2, one_launch=False), dict(block_n=64, block_k=128, split_k=2, wgmma=True)):
            y = w4a16_mma(x, fw, **cfg).float()
            assert (y - ref).norm() / ref.norm() < 2e-3, (m, cfg)


def compile_q6_cases() -> dict:
    """The Q6_K fragment kernels compiled for sm90 without a GPU: M = 1 (down and the head's shape), M = 16."""
    from quant_serve.kernels.matmul.frag.mma import _w4a16_mma_kernel
    from kernel_helpers import compile_sm90, mma_signature
    sig = mma_signature("*fp16", "*i32")
    out = {}
    for name, m, x_steps, wg in (("m1", 1, 16, False), ("m16", 16, 0, False), ("wgmma", 32, 0, True)):
        out[name] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=False, SPLIT=True, ONE_LAUNCH=True, GROUP=16, ZP_MODE=ZP_Q6, EVEN_N=True, EVEN_K=True,
            X_SMEM=m > 1, WGMMA=wg, PDL=True, SCALE_AFTER=False, X_STEPS=x_steps, SWIGLU=False, A_SMEM=False,
            BLOCK_M=8 if m == 1 else m, BLOCK_N=64, BLOCK_K=128, num_warps=4), 4)
    return out


def test_gluon_q6_kernels_compile_for_sm90_without_spills():
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_frag6", "compile_q6_cases")
    for name, r in res.items():
        assert r["stack"] == 0, (name, r)
        assert r["hgmma"] if name == "wgmma" else r["hmma"], (name, r)


def test_plan_caps_registers_only_where_the_dequant_fits_the_cap():
    """gate_up at M = 1 (two splits, SwiGLU): the one-wave register cap for INT4 codes and Q4_K, none for float
    offsets and Q6_K (their loops need 72 and 102 registers; capped at 56 they spill, offsets 47.4 against 35.6 us)."""
    from quant_serve.kernels.gpu import PROFILES
    from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_KQUANT, ZP_OFFSETS
    from quant_serve.kernels.matmul.plan import plan_w4a16
    caps = PROFILES["h200"]
    regs = {zp: plan_w4a16(1, 3584, 37888, caps, silu_mul=True, zp_mode=zp).config.max_regs
            for zp in (ZP_INT4, ZP_KQUANT, ZP_OFFSETS, ZP_Q6)}
    assert regs[ZP_INT4] == regs[ZP_KQUANT] == 56 and regs[ZP_OFFSETS] == regs[ZP_Q6] == 0, regs
    plan = plan_w4a16(1, 3584, 37888, caps, silu_mul=True, zp_mode=ZP_Q6)
    assert plan.config.split_k == 2 and "no register cap" in plan.why
