"""The decode step's RMSNorms folded into the INT4 matmuls around them (batch 1 on CUDA): o_proj / down_proj add the
residual and leave the stream's sums of squares by 64 columns, qkv_proj / gate_up_proj normalize the stream as they
stage it. On CPU: the twins against rms_norm_ref, and the decoder's folded path (forced, on the twins) against its
plain path. The kernels themselves: tests/test_kernels_w4a16_mma.py (GPU) and tests/test_engine_gpu.py."""
import pytest
import torch

from quant_serve.engine.models import fused_decode
from quant_serve.engine.sampling_params import SamplingParams
from helpers import awq_model_dir, make_engine
from quant_serve.kernels.norm_act import rms_norm_ref
from quant_serve.kernels.w4a16.fold import FOLD_TILE, FoldedNorm, folded_norm_ref, residual_ref

from conftest import DATA


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


def test_folded_decoder_path_matches_the_plain_one(monkeypatch):
    """The folded path's order of operations (first layer plain, then residual epilogue -> normed prologue, the final
    norm over the stream) gives the plain path's greedy tokens and scores, run on the twins (CPU, forced)."""
    engine = make_engine(awq_model_dir(), dtype="float32")
    ids = engine.tokenizer.encode((DATA / "val.txt").read_text()[:4000])
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
