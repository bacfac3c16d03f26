"""The calibrated searches pick what their docstrings say, checked against a brute force: search_clip (AWQ's and
GPTQ's clipping) takes, per output row and group, the candidate range with the least d^T G_g d."""
import pytest
import torch

from quant_serve.quant.rtn import _grouped, fake_quantize, search_clip

RATIOS = [1 - i / 20 for i in range(10)]


def brute_force_clip(weight, blocks, group_size, sym, two_d):
    n, k = weight.shape
    pairs = [(lo, hi) for lo in RATIOS for hi in RATIOS] if two_d and not sym else [(r, r) for r in RATIOS]
    errs = []
    for lo, hi in pairs:
        clip = torch.tensor([lo, hi]).view(2, 1, 1).expand(2, n, blocks.shape[0])
        diff, _ = _grouped(fake_quantize(weight, group_size, sym, clip) - weight, group_size)     # [N, G, gs]
        errs.append(torch.einsum("ngi,gij,ngj->ng", diff, blocks, diff))
    errs = torch.stack(errs)                                                                     # [P, N, G]
    best = errs.argmin(0)
    pairs = torch.tensor(pairs)
    return pairs[best].permute(2, 0, 1), float(errs.min(0).values.sum() / errs[0].sum())


@pytest.mark.parametrize("sym,two_d,group_size", [(False, True, 32), (True, True, 32), (False, False, 64),
                                                  (True, False, -1)])
def test_search_clip_is_the_brute_force_minimum(sym, two_d, group_size):
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * torch.linspace(0.01, 0.1, 64)
    x = torch.randn(300, 64) * torch.rand(64) * 2
    g = x.t() @ x
    gs = 64 if group_size == -1 else group_size
    blocks = torch.stack([g[i:i + gs, i:i + gs] for i in range(0, 64, gs)])
    clip, rel = search_clip(weight, blocks, group_size, sym, RATIOS, two_d)
    want, want_rel = brute_force_clip(weight, blocks, group_size, sym, two_d)
    assert clip.shape == (2, 48, 64 // gs)
    assert torch.equal(clip, want.float())
    assert rel == pytest.approx(want_rel, rel=1e-5) and rel < 1
