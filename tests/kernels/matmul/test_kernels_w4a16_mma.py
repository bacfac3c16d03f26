"""Fragment-layout W4A16 MMA kernel (kernels/matmul/frag/mma.py): the layout on CPU (exact round trip, the word's
nibble map), the Gluon kernel on the GPU against the torch twin. Gluon kernels do not run in the Triton
interpreter, so the kernel tests need the GPU machine."""
import pytest
import torch

from quant_serve.kernels.matmul.frag.layout import frag_codes, frag_standard, frag_words, pick_block_k, prepare_frag
from quant_serve.kernels.matmul.reference import dequantize_w4
from kernel_helpers import (compile_sm90, compiled_in_fresh_process, frag_case, make_weights, mma_signature, reference,
                            rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_frag_words_nibble_map_and_roundtrip():
    codes = torch.randint(0, 16, (192, 48), dtype=torch.int32)
    words = frag_words(codes)
    assert words.shape == (3, 3 * 128) and torch.equal(frag_codes(words), codes)
    # word (nt, kb, lane 4g+t, kt), nibble j = 4 b0 + 2 b2 + b1: row 64kb + 16kt + 2t + b0 + 8b2, column 16nt + g + 8b1
    for nt, kb, g, t, kt in [(0, 0, 0, 0, 0), (2, 1, 7, 3, 3), (1, 2, 4, 1, 2)]:
        word = words[nt, kb * 128 + (4 * g + t) * 4 + kt].item() & 0xFFFFFFFF
        for j in range(8):
            b0, b2, b1 = j >> 2, (j >> 1) & 1, j & 1
            assert (word >> 4 * j) & 0xF == codes[64 * kb + 16 * kt + 2 * t + b0 + 8 * b2, 16 * nt + g + 8 * b1]


def test_prepare_frag_pads_k_and_round_trips():
    qweight, scales, qzeros, gs, _ = make_weights(200, 32, -1, True, False, torch.float16, device="cpu")
    fw = prepare_frag(qweight, scales, qzeros, gs)
    assert fw.words.shape == (2, 256 // 64 * 128)        # K padded to 256 with code 0
    back = frag_standard(fw)
    assert torch.equal(back[0], qweight) and back[3] == 200
    assert not frag_codes(fw.words)[200:].any()           # pad rows hold code 0 (they meet x's masked zeros)


def test_prepare_frag_rejects_n_not_multiple_of_16():
    qweight, scales, qzeros, gs, _ = make_weights(128, 40, 64, True, False, torch.float16, device="cpu")
    with pytest.raises(ValueError, match="out_features % 16"):
        prepare_frag(qweight, scales, qzeros, gs)


def test_pick_block_k_lines_up_with_groups():
    assert pick_block_k(3584, 128, 256) == 256       # 3584 = 14 x 256; two groups per step
    assert pick_block_k(18944, 128, 256) == 256
    assert pick_block_k(192, 64, 256) == 64          # 192 has no 128 divisor
    assert pick_block_k(384, 0, 256) == 128          # one group: any divisor of Kp
    assert pick_block_k(384, 32, 256) == 128         # four groups per step


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,group_size,zeros", [(512, 256, 128, True), (384, 160, 64, False), (320, 96, 32, True),
                                                  (200, 48, -1, True), (3584, 4608, 128, True)])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 40, 64])
def test_gpu_mma_matches_twin(k, n, group_size, zeros, m):
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    fw, x, bias, ref = frag_case(k, n, group_size, zeros, m)
    for cfg in (dict(), dict(block_n=64, block_k=128, split_k=3), dict(block_n=64, block_k=128, split_k=5),
                dict(block_n=256, num_warps=8, split_k=8),
                dict(split_k=2, one_launch=False), dict(block_n=64, block_k=128, split_k=2, wgmma=True),
                dict(block_n=128, block_k=64, num_warps=8, split_k=3, one_launch=False, wgmma=True),
                dict(block_n=128, block_k=128, num_warps=8, split_k=2, one_launch=False, wgmma=True),
                dict(block_n=64, block_k=128, split_k=2, wgmma=True, a_smem=True)):
        assert rel_err(w4a16_mma(x, fw, bias, **cfg), ref) < 2e-3, cfg


@pytest.mark.gpu
def test_gpu_mma_takes_strided_and_misaligned_x():
    """x through cp.async (M > 1, wgmma) needs unit-stride, 16-byte aligned rows: other inputs are copied first."""
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    qweight, scales, qzeros, gs, _ = make_weights(512, 256, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float16, device=DEV)
    # transposed; rows starting 6 bytes past 16-byte alignment; row strides of 515 and 520 elements (520: rows
    # 16-byte aligned, but Triton cannot prove it from a stride that 16 does not divide)
    for x in (randn(512, 24).t(), randn(5, 520)[:, 3:515], randn(17, 515)[:, :512], randn(9, 520)[:, :512]):
        ref = reference(x.contiguous(), qweight, scales, qzeros, gs, None, None)
        for cfg in (dict(block_n=64, split_k=2), dict(block_n=64, split_k=2, wgmma=True)):
            assert rel_err(w4a16_mma(x, fw, **cfg), ref) < 2e-3, (x.stride(), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [65, 128, 200, 256, 300])
def test_gpu_wgmma_large_m_matches_twin(m):
    """wgmma tiles M by 128 rows (several row tiles above 128; one-launch counters per (column, row) tile)."""
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    qweight, scales, qzeros, gs, _ = make_weights(512, 384, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    x = torch.randn(m, 512, dtype=torch.float16, device=DEV)
    ref = reference(x, qweight, scales, qzeros, gs, None, None)
    for cfg in (dict(block_n=64, block_k=64, split_k=2), dict(block_n=128, block_k=128, num_warps=8),
                dict(block_n=128, block_k=128, num_warps=8, split_k=2, one_launch=False),
                dict(block_n=64, block_k=128, split_k=2, one_launch=False),
                dict(block_n=128, block_k=128, num_warps=8, a_smem=False)):      # A in registers, as M <= 64
        assert rel_err(w4a16_mma(x, fw, wgmma=True, **cfg), ref) < 2e-3, cfg


@pytest.mark.gpu
def test_gpu_mma_silu_mul_equals_unfused():
    from quant_serve.kernels.norm_act import silu_and_mul
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    qweight, scales, qzeros, gs, _ = make_weights(512, 512, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    for m, cfg in ((2, dict(split_k=2)), (2, dict(split_k=2, one_launch=False)), (16, dict(block_n=64, split_k=1)),
                   (1, dict(block_n=64, split_k=1)), (1, dict(block_n=128, split_k=2)),
                   (1, dict(block_n=64, split_k=2)), (3, dict(block_n=128, split_k=1)),
                   (5, dict(block_n=128, split_k=3)), (40, dict(block_n=64, split_k=2, wgmma=True, one_launch=False))):
        x = torch.randn(m, 512, dtype=torch.float16, device=DEV)
        # the reduce pass applies the SwiGLU, or the epilogue of the one split or of the split with the last ticket
        # (gate and up tiles of the same columns in one program): each rounds like the unfused pair
        assert torch.equal(w4a16_mma(x, fw, silu_mul=True, **cfg), silu_and_mul(w4a16_mma(x, fw, **cfg))), (m, cfg)


@pytest.mark.gpu
def test_gpu_residual_epilogue_and_folded_norm():
    """The decode step's RMSNorm folded into the matmuls (M = 1): the residual epilogue writes exactly the unfused
    matmul + torch add and the sums of squares of what it wrote (by 64 columns, a partial last tile included); the
    folded norm gives the matmul of the twin-normed x (the variance summed in another order: a tolerance), with and
    without the SwiGLU, one split or several (the last ticket's split writes)."""
    from quant_serve.kernels.matmul.frag.fold import FoldedNorm, folded_norm_ref, residual_ref
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    gen = torch.Generator().manual_seed(7)
    for k, n, split in ((512, 320, 1), (512, 320, 4), (1024, 80, 8)):
        qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, torch.float16)
        fw = prepare_frag(qweight, scales, qzeros, gs)
        x = torch.randn(1, k, generator=gen).half().to(DEV)
        residual = (torch.randn(1, n, generator=gen) * 4).half().to(DEV)
        bias = torch.randn(n, generator=gen).half().to(DEV)
        for b in (None, bias):
            h, ss = w4a16_mma(x, fw, b, block_n=64, split_k=split, residual=residual)
            y = w4a16_mma(x, fw, b, block_n=64, split_k=split)
            assert torch.equal(h, y + residual), (k, n, split)
            torch.testing.assert_close(ss, residual_ref(y, residual)[1], rtol=1e-5, atol=1e-3)
        # the norm: x is a stream of k columns with its sums of squares
        h_in = (torch.randn(1, k, generator=gen) * 3).half().to(DEV)
        norm = FoldedNorm(residual_ref(h_in, torch.zeros_like(h_in))[1], (torch.rand(k, generator=gen) + 0.5)
                          .half().to(DEV), 1e-6)
        for silu in (False, True):
            got = w4a16_mma(h_in, fw, block_n=64, split_k=split, silu_mul=silu, norm=norm)
            want = w4a16_mma(folded_norm_ref(h_in, norm), fw, block_n=64, split_k=split, silu_mul=silu)
            assert rel_err(got, want.cpu().float()) < 2e-3, (k, n, split, silu)
    with pytest.raises(ValueError, match="folded RMSNorm"):
        w4a16_mma(torch.randn(2, 512, device=DEV).half(), fw, block_n=64, norm=norm)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,scale", [(torch.float16, None), (torch.float8_e4m3fn, "tensor"),
                                               (torch.float8_e5m2, 0.5)])
def test_gpu_matmul_merges_decode_partials_as_it_stages_x(cache_dtype, scale):
    """Batch-1 decode: o_proj merges the decode kernel's split partials while it stages x (attention_merge.py):
    the result is the matmul of the merged attention output (merge_partials), up to the fp32 order of the sum
    over splits, for 1, 3 (a short last split) and 8 splits of K, with the residual epilogue and without."""
    from quant_serve.kernels.attention.merge import DecodePartials, merge_partials, merge_partials_ref
    from quant_serve.kernels.attention.paged import DecodeConfig, paged_decode
    from quant_serve.kernels.matmul.frag.fold import FoldedNorm
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, ctx = 8, 2, 128, 16, 700
    blocks = torch.randperm(64, generator=gen)[:64].to(torch.int32)
    tables, lens = blocks[None, :].to(DEV), torch.tensor([ctx], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    caches = [(torch.randn(64, bs, hkv, d, generator=gen) * 2).to(cache_dtype).to(DEV) for _ in range(2)]
    s = torch.tensor(0.7, device=DEV) if scale == "tensor" else (scale or 1.0)
    q = torch.randn(1, hq, d, generator=gen).half().to(DEV)
    p = paged_decode(q, *caches, tables, lens, qsl, d ** -0.5, s, s, DecodeConfig(block_n=64, num_splits=16),
                     merge=False)
    assert isinstance(p, DecodePartials) and p.splits == 16
    ref = merge_partials_ref(p)
    x = merge_partials(p).view(1, -1).clone()
    assert (x.float() - ref.view(1, -1).float()).abs().max() < 2e-3
    qweight, scales, qzeros, gs, _ = make_weights(hq * d, 320, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    residual = torch.randn(1, 320, generator=gen).half().to(DEV)
    for split in (1, 3, 8):
        got = w4a16_mma(p, fw, block_n=64, split_k=split)
        want = w4a16_mma(x, fw, block_n=64, split_k=split)
        assert rel_err(got, want.cpu().float()) < 1e-3, split
        (h, ss), (h_want, ss_want) = (w4a16_mma(a, fw, block_n=64, split_k=split, residual=residual) for a in (p, x))
        assert rel_err(h, h_want.cpu().float()) < 1e-3 and rel_err(ss, ss_want.cpu().float()) < 1e-3, split
    with pytest.raises(ValueError, match="split partials"):
        w4a16_mma(p, fw, block_n=64, norm=FoldedNorm(ss, residual[0], 1e-6))


@pytest.mark.gpu
def test_gpu_preloaded_split_and_register_cap_change_no_bit():
    """M = 1 splits of at most four steps request all their weights before the PDL wait (preload): the same
    bits as the stepwise loop, for one to four steps a split (a short last split included), with the residual
    epilogue, the folded norm and the SwiGLU; the register cap of one_wave_regs changes no bit either."""
    from quant_serve.kernels.pdl import pdl_enabled
    from quant_serve.kernels.matmul.frag.fold import FoldedNorm, residual_ref
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    if not pdl_enabled(torch.zeros(1, device=DEV)):
        pytest.skip("the preload applies under PDL only (sm90 and newer, KernelOptions.pdl on)")
    gen = torch.Generator().manual_seed(11)
    for k, n, split in ((1024, 192, 2), (1024, 192, 3), (1152, 320, 3), (512, 128, 4), (1024, 320, 8)):
        qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, torch.float16)
        fw = prepare_frag(qweight, scales, qzeros, gs)
        x = torch.randn(1, k, generator=gen).half().to(DEV)
        residual = torch.randn(1, n, generator=gen).half().to(DEV)
        h_in = (torch.randn(1, k, generator=gen) * 3).half().to(DEV)
        norm = FoldedNorm(residual_ref(h_in, torch.zeros_like(h_in))[1], (torch.rand(k, generator=gen) + 0.5)
                          .half().to(DEV), 1e-6)
        for kw in (dict(), dict(residual=residual), dict(norm=norm), dict(norm=norm, silu_mul=True)):
            xi = h_in if "norm" in kw else x
            got = w4a16_mma(xi, fw, block_n=64, split_k=split, preload=True, **kw)
            want = w4a16_mma(xi, fw, block_n=64, split_k=split, preload=False, **kw)
            capped = w4a16_mma(xi, fw, block_n=64, split_k=split, preload=False, max_regs=56, **kw)
            for g, w, c in zip(*[t if isinstance(t, tuple) else (t,) for t in (got, want, capped)]):
                assert torch.equal(g, w) and torch.equal(c, w), (k, n, split, list(kw))


def test_cpu_keeps_row_layout_and_twin_reads_fragment_layout():
    from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights, w4a16_matmul
    from quant_serve.kernels.matmul.rows.layout import W4A16Weights
    qweight, scales, qzeros, gs, perm = make_weights(256, 64, 64, True, True, torch.float16, device="cpu")
    assert isinstance(prepare_kernel_weights(qweight, scales, qzeros, gs, perm), W4A16Weights)   # no GPU: rows
    fw = prepare_frag(qweight, scales, qzeros, gs, perm)
    x = torch.randn(3, 256, dtype=torch.float16)
    ref = reference(x, qweight, scales, qzeros, gs, perm, None)
    assert torch.equal(w4a16_matmul(x, fw), ref.to(torch.float16))


def test_mma_variant_picks_scales_after_and_staged_x_where_they_apply():
    from quant_serve.kernels.matmul.frag.mma import mma_variant
    # (block_k, steps per split, splits, scales after the MMA, staged x rows)
    def v(*args, **kw):
        r = mma_variant(*args, **kw)
        return r.block_k, r.per_split, r.splits, r.scale_after, r.x_steps
    assert v(1, 18944, 128, 64, 128, 16, False) == (128, 10, 15, True, 16)         # down at M = 1
    assert v(1, 3584, 128, 64, 128, 1, False) == (128, 28, 1, True, 32)            # plain gate_up at M = 1
    assert v(1, 3584, 128, 128, 128, 2, False)[3:] == (True, 0)       # 128-column tile: x not staged
    assert v(1, 18944, 128, 64, 128, 1, False)[3:] == (True, 0)       # 148 steps of x: over 16 KB
    assert v(16, 3584, 128, 64, 128, 8, False)[3:] == (True, 0)       # x staged only at M = 1
    assert v(1, 3584, 0, 64, 128, 8, False)[3] is True                # one group for all of K
    assert v(1, 3584, 32, 64, 128, 8, False)[3] is False              # groups inside a step: scaled per weight
    assert v(1, 3584, 64, 64, 128, 8, False)[3] is False
    assert v(32, 3584, 128, 64, 128, 8, True)[3:] == (False, 0)       # wgmma: neither
    assert v(1, 3584, 128, 64, 128, 8, False, scale_after=False, x_staged=False)[3:] == (False, 0)
    # one barrier after the staging, except on long K (down: Triton's barrier in every step)
    assert [mma_variant(1, k, 128, 64, 128, 16, False).x_once for k in (3584, 18944)] == [True, False]
    assert mma_variant(1, 18944, 128, 64, 128, 16, False, x_once=True).x_once is True
    # wgmma's A tile through shared memory above 64 rows only (exp-mma-ss-h200.json)
    assert [mma_variant(m, 3584, 128, 128, 128, 2, True).a_smem for m in (17, 64, 65, 128)] == [False] * 2 + [True] * 2
    assert mma_variant(128, 3584, 128, 128, 128, 2, False).a_smem is False


def test_mma_config_rule_reproduces_the_sweep_winners():
    from quant_serve.kernels.matmul.rules import select_mma_config
    # (K, N, M) -> (block_n, block_k, split_k, one_launch): bench/results/exp-mma-h200.json winners
    def cfg(m, k, n):
        c = select_mma_config(m, k, n)
        return c.block_n, c.block_k, c.split_k, c.one_launch
    assert cfg(1, 3584, 4608) == (64, 128, 8, True)
    # two splits at M = 1 on wide layers, registers capped so the grid is resident at once (exp-reg-cap-h200.json)
    assert cfg(1, 3584, 37888) == (64, 128, 2, True) and select_mma_config(1, 3584, 37888).max_regs == 56
    swiglu = select_mma_config(1, 3584, 37888, silu_mul=True)               # exp-m1-splits-h200.json
    assert (swiglu.block_n, swiglu.split_k, swiglu.one_launch, swiglu.max_regs) == (64, 2, True, 56)
    # Llama-3.1-8B's gate_up (1,792 programs in two splits): no cap reaches one wave on 132 SMs; the SwiGLU keeps
    # its two splits, a plain layer one; a smaller GPU gets no cap; no other layer is capped
    assert (select_mma_config(1, 4096, 57344, silu_mul=True).split_k, cfg(1, 4096, 57344)[2]) == (2, 1)
    assert select_mma_config(1, 4096, 57344, silu_mul=True).max_regs == 0
    assert select_mma_config(1, 3584, 37888, silu_mul=True, sms=72).max_regs == 0
    assert all(select_mma_config(m, k, n).max_regs == 0 for m in (1, 2, 16) for k, n in
               ((3584, 4608), (3584, 3584), (18944, 3584))) and select_mma_config(2, 3584, 37888).max_regs == 0
    assert cfg(4, 3584, 37888) == (64, 128, 1, True)                       # exp-swiglu-small-m-h200.json
    for m in (2, 8):                                                       # SwiGLU in the epilogue
        assert (select_mma_config(m, 3584, 37888, silu_mul=True).split_k, cfg(m, 3584, 37888)[2]) == (1, 1)
    assert cfg(1, 18944, 3584) == (64, 128, 16, True)                      # exp-mma-split16-h200.json
    assert cfg(16, 3584, 37888) == (64, 128, 1, True)
    # M = 9..16: 5 splits on short K, 12 on long K (exp-mma-splits-h200.json); M = 8 keeps the powers of two
    assert [cfg(m, 18944, 3584)[2] for m in (2, 8, 9, 16)] == [14, 14, 12, 12]      # exp-mma-bufs3-h200.json
    assert [cfg(m, 3584, n)[2] for m in (8, 9, 16) for n in (4608, 3584)] == [8, 8, 5, 5, 5, 5]
    assert cfg(9, 3584, 37888) == (64, 128, 1, True)
    assert cfg(64, 3584, 4608) == (128, 128, 8, False)
    assert select_mma_config(65, 3584, 4608) is None                       # dequantize + cuBLAS
    # wgmma (sm90) above M = 16: bench/results/exp-mma-wgmma-h200.json winners
    def wg(m, k, n):
        c = select_mma_config(m, k, n, wgmma=True)
        return c.block_n, c.num_warps, c.split_k, c.one_launch, c.wgmma
    assert select_mma_config(16, 3584, 4608, wgmma=True).wgmma is False
    assert wg(32, 3584, 4608) == (64, 4, 8, False, True)
    assert wg(32, 18944, 3584) == (64, 4, 8, False, True)
    assert wg(64, 3584, 4608) == (128, 8, 8, False, True)
    assert wg(64, 18944, 3584) == (128, 8, 8, False, True)
    assert wg(128, 3584, 37888) == (128, 8, 2, False, True)
    assert select_mma_config(129, 3584, 37888, wgmma=True) is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 17, 64, 65, 128, 129, 200])
def test_gpu_dispatcher_on_fragment_layout(m):
    """QuantLinear's path on CUDA: the fragment layout, mma.sync up to M = 16 (64 off sm90), wgmma to 128,
    dequantize + cuBLAS above; act-order, bias and the fused SwiGLU included."""
    from quant_serve.kernels.norm_act import silu_and_mul
    from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights, w4a16_matmul
    from quant_serve.kernels.matmul.frag.layout import FragWeights
    qweight, scales, qzeros, gs, perm = make_weights(512, 384, 128, True, True, torch.float16)
    w = prepare_kernel_weights(qweight, scales, qzeros, gs, perm)
    assert isinstance(w, FragWeights)
    x = torch.randn(m, 512, dtype=torch.float16, device=DEV)
    bias = torch.randn(384, dtype=torch.float16, device=DEV)
    ref = reference(x, qweight, scales, qzeros, gs, perm, bias)
    y = w4a16_matmul(x, w, bias=bias)
    assert rel_err(y, ref) < 2e-3
    fused = w4a16_matmul(x, w, bias=bias, silu_mul=True)
    assert rel_err(fused, silu_and_mul(ref.to(torch.float16).to(DEV)).float().cpu()) < 5e-3


@pytest.mark.gpu
def test_gpu_frag_dequantize_exact():
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    for k, n, group_size, zeros in [(512, 256, 128, True), (200, 48, -1, False), (320, 96, 32, True)]:
        qweight, scales, qzeros, gs, _ = make_weights(k, n, group_size, zeros, False, torch.float16)
        exact = dequantize_w4(qweight, scales, qzeros, gs, torch.float32).to(torch.float16)   # [K, N]
        assert torch.equal(frag_dequantize(prepare_frag(qweight, scales, qzeros, gs)), exact.t())


COMPILE_CASES = [(1, 3584, 37888), (1, 18944, 3584), (16, 3584, 4608), (64, 3584, 3584)]
# the dispatcher's wgmma tiles: BLOCK_M, BLOCK_N, BLOCK_K, warps
WGMMA_CASES = [(32, 64, 128, 4), (64, 128, 128, 8), (128, 128, 128, 8)]


def compile_cases() -> dict:
    """The dispatcher's mma configurations for the Qwen2.5-7B shapes and the dequantize kernel, compiled for sm90."""
    from quant_serve.kernels.matmul.frag.mma import _w4a16_mma_kernel, mma_variant
    from quant_serve.kernels.matmul.frag.tiles import _frag_dequant_kernel
    from quant_serve.kernels.matmul.rules import select_mma_config
    sig = mma_signature()
    out = {}
    for m, k, n in COMPILE_CASES:
        cfg = select_mma_config(m, k, n)
        v = mma_variant(m, k, 128, cfg.block_n, cfg.block_k, cfg.split_k, False)
        out[f"{m}-{k}-{n}"] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=False, SPLIT=cfg.split_k > 1, ONE_LAUNCH=cfg.one_launch, GROUP=128, ZP_MODE=1,
            EVEN_N=True, EVEN_K=True, X_SMEM=m > 1, WGMMA=False, PDL=True, SCALE_AFTER=v.scale_after,
            X_STEPS=v.x_steps, SWIGLU=False, A_SMEM=False, X_ONCE=v.x_once,
            BLOCK_M=8 if m <= 8 else 16 if m <= 16 else 64,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps), cfg.num_warps)
    for m, bn, bk, nw in WGMMA_CASES:                 # sm90, M = 17..128
        out[f"wgmma-{m}-{bn}-{bk}-{nw}"] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=True, SPLIT=True, ONE_LAUNCH=False, GROUP=128, ZP_MODE=1, EVEN_N=True, EVEN_K=True,
            X_SMEM=True, WGMMA=True, PDL=True, SCALE_AFTER=False, X_STEPS=0, SWIGLU=False, A_SMEM=m > 64, BLOCK_M=m,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=nw), nw)
    # gate_up at M = 1 with the SwiGLU in the epilogue: 64 columns, one split, x staged
    out["swiglu"] = compile_sm90(_w4a16_mma_kernel, sig, dict(
        HAS_BIAS=False, SPLIT=False, ONE_LAUNCH=False, GROUP=128, ZP_MODE=1, EVEN_N=True, EVEN_K=True,
        X_SMEM=False, WGMMA=False, PDL=True, SCALE_AFTER=True, X_STEPS=32, SWIGLU=True, A_SMEM=False, BLOCK_M=8,
        BLOCK_N=64, BLOCK_K=128, num_warps=4), 4)
    # the decode step's gate_up at M = 1: 64 columns, two splits, the split with the last ticket applies it
    out["swiglu_split"] = compile_sm90(_w4a16_mma_kernel, sig, dict(
        HAS_BIAS=False, SPLIT=True, ONE_LAUNCH=True, GROUP=128, ZP_MODE=1, EVEN_N=True, EVEN_K=True,
        X_SMEM=False, WGMMA=False, PDL=True, SCALE_AFTER=True, X_STEPS=16, SWIGLU=True, A_SMEM=False, BLOCK_M=8,
        BLOCK_N=64, BLOCK_K=128, num_warps=4), 4)
    # the decode step's RMSNorm folded in (M = 1): the residual epilogue of o / down, the norm of qkv / gate_up
    for name, k, n, silu, fold in (("residual_o", 3584, 3584, False, "RESIDUAL"),
                                   ("residual_down", 18944, 3584, False, "RESIDUAL"),
                                   ("norm_qkv", 3584, 4608, False, "NORM"), ("norm_gate_up", 3584, 37888, True, "NORM")):
        cfg = select_mma_config(1, k, n, silu_mul=silu)
        v = mma_variant(1, k, 128, cfg.block_n, cfg.block_k, cfg.split_k, False)
        out[name] = compile_sm90(_w4a16_mma_kernel, sig, dict(
            HAS_BIAS=name == "norm_qkv", SPLIT=v.splits > 1, ONE_LAUNCH=True, GROUP=128, ZP_MODE=1,
            EVEN_N=True, EVEN_K=True, X_SMEM=False, WGMMA=False, PDL=True, SCALE_AFTER=v.scale_after,
            X_STEPS=v.x_steps, SWIGLU=silu, A_SMEM=False, BLOCK_M=8, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            RESIDUAL=fold == "RESIDUAL", NORM=fold == "NORM", SS_P2=64, PRELOAD=v.per_split <= 4, X_ONCE=v.x_once,
            num_warps=cfg.num_warps), cfg.num_warps, cfg.max_regs or None)
    # o at M = 1 merging the batch-1 decode's 16 split partials as it stages x (fp8 KV: the scale by pointer)
    cfg = select_mma_config(1, 3584, 3584)
    out["merge_o"] = compile_sm90(_w4a16_mma_kernel, dict(sig, x_ptr="*fp32"), dict(
        HAS_BIAS=False, SPLIT=True, ONE_LAUNCH=True, GROUP=128, ZP_MODE=1, EVEN_N=True, EVEN_K=True,
        X_SMEM=False, WGMMA=False, PDL=True, SCALE_AFTER=True, X_STEPS=4, SWIGLU=False, A_SMEM=False, BLOCK_M=8,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, RESIDUAL=True, SS_P2=64, PRELOAD=True, MERGE_SPLITS=16,
        MERGE_SCALE=2, num_warps=cfg.num_warps), cfg.num_warps)
    sig = dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*i32", out_ptr="*fp16", N="i32", K="i32", KP="i32",
               stride_sg="i32", stride_zg="i32")
    out["dequant"] = compile_sm90(_frag_dequant_kernel, sig, dict(GROUP=32, ZP_MODE=1, BLOCK_N=64,
                                                                    BLOCK_K=128, num_warps=4), 4)
    return out


def test_gluon_kernels_compile_for_sm90_without_spills():
    """The dispatcher's configurations compile for the H100/H200 on any machine (a fresh process: the CPU tests'
    interpreter mode patches Triton's builder): the dequantized words are the MMA's A operand in registers (the
    trivial-layout assertion holds), tensor-core MMAs, no spills, ldmatrix for x (staged in shared memory at M = 1
    with 64-column tiles, a tile per step above M = 1; the weights never go through shared memory), 16-byte stores
    of the dense rows in the dequantize kernel."""
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_mma", "compile_cases")
    for m, k, n in COMPILE_CASES:
        r = res[f"{m}-{k}-{n}"]
        assert r["hmma"] and r["stack"] == 0 and r["ldsm"], (m, k, n, r)
    # M > 1: one CTA barrier a step (16 MMAs a step at 16 rows), not two (x's tiles in three buffers of their own)
    hmma, bars = res["16-3584-4608"]["loop_hmma_bar"]
    assert hmma and hmma == 16 * bars, (hmma, bars)
    for m, bn, bk, nw in WGMMA_CASES:
        r = res[f"wgmma-{m}-{bn}-{bk}-{nw}"]
        assert r["hgmma"] and r["stack"] == 0 and not r["ldsm"], (m, bn, bk, nw, r)
    assert res["dequant"]["stack"] == 0 and res["dequant"]["stg128"]
    assert res["swiglu"]["hmma"] and res["swiglu"]["stack"] == 0
    assert res["swiglu_split"]["hmma"] and res["swiglu_split"]["stack"] == 0
    for name in ("residual_o", "residual_down", "norm_qkv", "norm_gate_up"):
        assert res[name]["hmma"] and res[name]["ldsm"], (name, res[name])
        # gate_up runs capped at 56 registers (one_wave_regs): ptxas spills a few there (8 bytes with Triton 3.6's,
        # 24 with 3.9's; the H200 run of exp-reg-cap-h200.json reported none for the SwiGLU variant without the norm)
        assert res[name]["stack"] <= (32 if name == "norm_gate_up" else 0), (name, res[name])
    # qkv and o (four steps a split) request all their weights before the wait (2 x 16-byte word loads a step;
    # qkv's norm weight is one more), down and gate_up their first step only
    before_wait = {name: res[name]["wide_loads_before_wait"] for name in
                   ("residual_o", "norm_qkv", "residual_down", "norm_gate_up")}
    assert before_wait == {"residual_o": 8, "norm_qkv": 9, "residual_down": 2, "norm_gate_up": 4}, before_wait
    # down's long K keeps Triton's barrier in every step (mma_variant's x_once): its splits issue the next step's two
    # 16-byte weight loads before the step's MMAs (with one barrier after the staging ptxas sinks them below)
    assert res["1-18944-3584"]["loads_ahead_in_loop"] == res["residual_down"]["loads_ahead_in_loop"] == 2, res
    # the merge's 16 splits of partials stay one wave: 392 programs, 3 an SM at most 168 registers (137 offline)
    merge = res["merge_o"]
    assert merge["hmma"] and merge["stack"] == 0 and merge["regs"] <= 168 and merge["wide_loads_before_wait"] == 8


def test_layout_probe_failure_falls_back_to_rows_with_a_warning(caplog):
    """A Triton whose Gluon cannot build or run the kernel (here: no GPU at all) must cost speed, not the load."""
    from quant_serve.kernels.matmul.probes import _mma_kernels_work
    if torch.cuda.is_available():
        assert _mma_kernels_work(torch.cuda.current_device())
        return
    with caplog.at_level("WARNING", logger="quant_serve"):
        assert _mma_kernels_work.__wrapped__(0) is False
    assert "row-layout kernels" in caplog.text


def test_wgmma_probe_failure_falls_back_with_a_warning(caplog):
    """The wgmma variant serves only where its probe passes: an sm90 GPU (H100/H200); elsewhere mma.sync and the
    dequantize path serve, and a failed probe says so."""
    from quant_serve.kernels.matmul.probes import _wgmma_works
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() == (9, 0):
            assert _wgmma_works(torch.cuda.current_device())
        return
    with caplog.at_level("WARNING", logger="quant_serve"):
        assert _wgmma_works.__wrapped__(0) is False
    assert "wgmma kernel unavailable" in caplog.text
