"""GPTQ (Frantar et al. 2022; the AutoGPTQ / GPTQModel algorithm) and its true-sequential pass over one block.

Each linear is quantized column by column in the order of its input channels (optionally by descending Hessian
diagonal: act-order), and each column's rounding error is spread over the not-yet-quantized columns through the
inverse Hessian H = 2 X^T X / T of its input. Inside a block the linears are visited in forward order
(q/k/v, o, gate/up, down) and each one's Hessian is taken from inputs computed with the already quantized ones.
"""
from dataclasses import dataclass

import torch

from quant_serve.quant.block import CalibBlock, chunked, gram
from quant_serve.quant.rtn import MAXQ, QuantResult, group_params, search_clip

CLIP_RATIOS = [1 - i / 20 for i in range(10)]            # AWQ's grid: 1.0, 0.95, ..., 0.55


@dataclass
class GPTQSettings:
    damp_percent: float = 0.01        # damping = damp_percent * mean(diag(H))
    block_size: int = 128             # columns per lazy batch update
    act_order: bool = False           # desc_act: visit columns by descending diag(H)
    static_groups: bool = False       # with act_order: groups fixed on the original order (g_idx = k // G)
    clip_search: bool = True          # group ranges shrunk to minimize the group's H-weighted output error
    chunk: int = 8                    # sequences per forward chunk


@torch.no_grad()
def gptq_block(w: dict[str, torch.Tensor], x: torch.Tensor, block: CalibBlock, group_size: int, sym: bool,
               settings: GPTQSettings) -> tuple[dict[str, QuantResult], torch.Tensor]:
    """w: the block's checkpoint-named fp32 weights (linears replaced in place by their dequantized values);
    x [S, L, H]. -> (QuantResult per linear, quantized block's output [S, L, H] for the next block)."""
    c = settings.chunk
    results: dict[str, QuantResult] = {}
    stages = [block.qkv, [block.o], block.gate_up, [block.down]]

    def run(stage: int, inp: torch.Tensor) -> None:
        h = gram(inp) * (2 / (inp.numel() // inp.shape[-1]))                      # [K, K]
        for name in stages[stage]:
            results[name] = gptq_quantize(w[f"{name}.weight"], h, group_size, sym, settings)
            results[name].bias = w.get(f"{name}.bias")
            w[f"{name}.weight"] = results[name].dequantize(group_size)
        del h

    a = chunked(lambda t: block.attn_input(w, t), x, chunk=c)                      # [S, L, H]
    run(0, a)
    o = chunked(lambda t: block.attn_core(w, t), a, chunk=c)                       # [S, L, Hq*D]
    del a
    run(1, o)
    hm = [chunked(lambda t, u: block.mlp_input(w, t, u)[i], x, o, chunk=c) for i in (0, 1)]
    del o
    run(2, hm[1])
    d = chunked(lambda t: block.mlp_act(w, t), hm[1], chunk=c)                     # [S, L, I]
    run(3, d)
    return results, chunked(lambda t, u: block.block_output(w, t, u), hm[0], d, chunk=c)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, sym: bool,
                  settings: GPTQSettings) -> QuantResult:
    """weight [N, K], hessian [K, K] -> QuantResult with codes in the original K order (g_idx set for act-order)."""
    W = weight.clone().float()
    n, k = W.shape
    gs = k if group_size <= 0 else group_size
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    static = None
    if settings.static_groups or group_size <= 0:
        static = [_params(W[:, i:i + gs], H[i:i + gs, i:i + gs], sym, settings)      # on the original order
                  for i in range(0, k, gs)]
    perm = None
    if settings.act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = _inverse_cholesky(H, settings.damp_percent)

    codes = torch.zeros(n, k, dtype=torch.int32, device=W.device)
    scales, zeros = [], []
    orig = perm if perm is not None else torch.arange(k, device=W.device)   # column j holds input channel orig[j]
    orig_group = (orig // gs).tolist()
    for i1 in range(0, k, settings.block_size):
        i2 = min(i1 + settings.block_size, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                scale, zero = static[orig_group[col]]
            elif col % gs == 0:                                 # a new group, formed in visiting order
                # the group's columns as updated so far (AutoGPTQ reads W here, stale when G < block_size)
                scale, zero = _params(torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :gs], H[col:col + gs, col:col + gs],
                                      sym, settings)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)
            codes[:, col] = q.to(torch.int32)
            err = (w - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if static is not None:
        scales, zeros = [p[0] for p in static], [p[1] for p in static]
        g_idx = None
    else:
        g_idx = torch.empty(k, dtype=torch.int32, device=W.device)
        g_idx[orig] = (torch.arange(k, device=W.device) // gs).to(torch.int32)    # group of each input channel
        if perm is None:
            g_idx = None
    if perm is not None:
        codes = torch.empty_like(codes).index_copy_(1, perm, codes)         # back to the original K order
    scales_t = torch.stack(scales)                                          # [G, N]
    zeros_t = None if sym else torch.stack(zeros).to(torch.int32)
    return QuantResult(codes, scales_t, zeros_t, g_idx)


def _params(block: torch.Tensor, h: torch.Tensor, sym: bool, settings: GPTQSettings
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [N] of a group of columns [N, gs] (its Hessian block h [gs, gs]), scales rounded to fp16
    (what is stored): min-max, or with clip_search the range shrink minimizing the H-weighted rounding error."""
    lo = hi = 1.0
    if settings.clip_search:
        clip, _ = search_clip(block, h[None], block.shape[1], sym, CLIP_RATIOS)                 # [2, N, 1]
        lo, hi = clip[0, :, 0], clip[1, :, 0]
    return group_params(block.amin(dim=1) * lo, block.amax(dim=1) * hi, sym, torch.float16)


def _inverse_cholesky(H: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of the damped H^-1; the damping grows tenfold while H is not positive definite."""
    damp = damp_percent * torch.mean(torch.diag(H))
    eye = torch.eye(H.shape[0], device=H.device, dtype=H.dtype)
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            L, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return L
        damp = damp * 10
    raise ValueError(f"GPTQ: the Hessian stays singular even with damping {damp:.3g}; use more calibration text")
