"""The decode step's RMSNorms folded into the INT4 matmuls around them (batch 1 on CUDA): o_proj / down_proj add the
residual and leave the stream's sums of squares by 64 columns, qkv_proj / gate_up_proj normalize the stream as they
stage it. On CPU: the twins against rms_norm_ref, and the decoder's folded path (forced, on the twins) against its
plain path. The kernels themselves: tests/kernels/matmul/test_kernels_w4a16_mma.py (GPU) and tests/engine/worker/test_engine_gpu.py."""
import pytest
import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.models import fused_decode
from quant_serve.engine.sampling_params import SamplingParams
from helpers import make_engine
from quant_serve.kernels.norm_act import rms_norm_ref
from quant_serve.kernels.matmul.frag.fold import FOLD_TILE, FoldedNorm, folded_norm_ref, residual_ref


@pytest.mark.parametrize("n", [256, 200])
def test_twins_equal_the_norm_they_fold(n):
    """residual_ref + folded_norm_ref give rms_norm_ref(y, weight, eps, residual): the same stream bit for bit, the
    normed output up to the variance's summation order; the sums cover a last, partial tile."""
    gen = torch.Generator().manual_seed(n)
    y, residual = (torch.randn(1, n, generator=gen).half() * 3 for _ in range(2))
    weight = (torch.rand(n, generator=gen) + 0.5).half()
    h, ss = residual_ref(y, residual)
    assert ss.shape == (1, -(-n // FOLD_TILE)) and ss.dtype == torch.float32
    normed, stream = rms_norm_ref(y, weight, 1e-6, residual)
    assert torch.equal(h, stream)
    torch.testing.assert_close(ss.sum(), h.float().pow(2).sum())
    got = folded_norm_ref(h, FoldedNorm(ss, weight, 1e-6))
    assert got.dtype == normed.dtype and (got.float() - normed.float()).abs().max() <= 2e-3 * normed.abs().max()


def test_folded_decoder_path_matches_the_plain_one(monkeypatch, heldout_text):
    """The folded path's order of operations (first layer plain, then residual epilogue -> normed prologue, the final
    norm over the stream) gives the plain path's greedy tokens and scores, run on the twins (CPU, forced)."""
    engine = make_engine(DEMO_MODEL_DIR, dtype="float32")                       # INT4 AWQ, a trained model
    ids = engine.tokenizer.encode(heldout_text[:4000])
    prompts = [ids[i * 97: i * 97 + 9 + 5 * i] for i in range(3)]
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=2)
    plain = [engine.generate([p], params)[0].outputs[0] for p in prompts]          # batch 1: one token a step
    calls = []
    real = fused_decode.forward

    def counted(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(fused_decode, "applies", lambda model, x: x.shape[0] == 1)
    monkeypatch.setattr(fused_decode, "forward", counted)
    folded = [engine.generate([p], params)[0].outputs[0] for p in prompts]
    assert len(calls) >= 3 * 11                                                   # every decode step took it
    for a, b in zip(plain, folded):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) < 1e-3
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["q4k", "q6k"])
def test_gpu_fold_kernels_with_gguf_layouts_match_unfused(mode):
    """The residual epilogue and the normed prologue (plain and SwiGLU) over Q4_K's two-level scales and Q6_K's
    fragment layout, against the dense matmul of the same weights around the twins."""
    from quant_serve.kernels.matmul.frag.fold import folded_norm_applies, w4a16_normed, w4a16_residual
    k = n = 512
    if mode == "q4k":
        from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights
        from kernel_helpers import q4_k_layer
        _, dense, qweight, sub, sup = q4_k_layer(k, n)
        fw = prepare_kernel_weights(qweight, sub, None, 32, superscales=sup, scale_dtype=torch.float16)
    else:
        from quant_serve.kernels.matmul.frag.q6k import frag6_dequantize_ref, pack_frag6
        from quant_serve.kernels.matmul.planes.q6k import q6k_codes, q6k_scales
        from kernel_helpers import q6k_layer
        w = q6k_layer(k, n, "cuda")
        fw = pack_frag6(q6k_codes(w), q6k_scales(w))
        dense = frag6_dequantize_ref(fw).float().cpu()
    assert folded_norm_applies(fw) and folded_norm_applies(fw, silu_mul=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(1, k, generator=gen, device="cuda").half() for _ in range(2))

    def rel(y, ref):
        return ((y.float().cpu() - ref).norm() / ref.norm()).item()
    h, ss = w4a16_residual(x, fw, residual)
    assert rel(h, x.float().cpu() @ dense + residual.float().cpu()) < 2e-3
    torch.testing.assert_close(ss.sum(), h.float().pow(2).sum(), rtol=1e-5, atol=0)
    norm = FoldedNorm(ss, (torch.rand(k, generator=gen, device="cuda") + 0.5).half(), 1e-6)
    r = folded_norm_ref(h, norm).float().cpu() @ dense
    assert rel(w4a16_normed(h, fw, norm), r) < 2e-3
    swiglu = torch.nn.functional.silu(r[:, : n // 2]) * r[:, n // 2:]
    assert rel(w4a16_normed(h, fw, norm, silu_mul=True), swiglu) < 5e-3
