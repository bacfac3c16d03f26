"""AWQ (Lin et al. 2023; AutoAWQ's search) for one decoder block: activation-aware scales folded into the previous
op, then a per-group clipping search, then asymmetric RTN of the scaled, clipped weights.

Differences from AutoAWQ, each so that the search optimizes what the checkpoint will actually hold:
- fp32 math, and the candidate weights are quantized with fp16-rounded scales (what the writer stores);
- the identity scale (plain RTN) is a candidate too, so a group's loss is never worse than RTN's on calibration;
- losses of purely linear targets (o_proj, down_proj, clipping) use the input Gram matrix X^T X, which is exact
  over every calibration token instead of a subsample;
- asymmetric clipping searches the min and the max shrink independently (AutoAWQ clips to a symmetric +-max).

The next block is calibrated on the FP block's output, as AutoAWQ does: AWQ's statistics (mean |x| per channel)
and targets (the FP module output) describe the FP model, and unlike GPTQ it has no error compensation that
quantized inputs would feed (measured on tiny-qwen2: docs/kernels.md, "AWQ propagation").
"""
import logging
from dataclasses import dataclass

import torch

from quant_serve.quant.block import CalibBlock, chunked, gram
from quant_serve.quant.rtn import QuantResult, fake_quantize, quantize_rtn, search_clip

# their error acts through q.k, not through their outputs (a fused qkv_proj, Phi-3's, is clipped whole, as AutoAWQ does)
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")

logger = logging.getLogger("quant_serve")


@dataclass
class AWQSettings:
    n_grid: int = 20                  # alpha in {0, 1/20, ..., 19/20}
    max_shrink: float = 0.5           # clip ratios 1.0, 0.95, ..., 0.55
    clip_2d: bool = True              # asym: shrink min and max independently (10 x 10 grid)
    search_tokens: int = 8192         # tokens (whole sequences) for the attention / MLP output losses
    propagate: str = "fp"             # next block's input: the FP block's output (AutoAWQ) or "quantized"
    chunk: int = 8                    # sequences per forward chunk (bounds activation memory)


# The scale search runs every candidate's attention and MLP on its tokens, most of AWQ's time on a CPU; a quarter of
# the tokens scored as well on the fixture (bench/results/default-calib-cpu-tiny-qwen2.json). CUDA keeps 8192.
CPU_SEARCH_TOKENS = 2048


def default_search_tokens(device: str) -> int:
    """AWQSettings.search_tokens for `quant-serve quantize` without --awq-search-tokens."""
    return AWQSettings.search_tokens if torch.device(device).type == "cuda" else CPU_SEARCH_TOKENS


@torch.no_grad()
def awq_block(w: dict[str, torch.Tensor], x: torch.Tensor, block: CalibBlock, group_size: int, sym: bool,
              settings: AWQSettings) -> tuple[dict[str, QuantResult], torch.Tensor]:
    """w: the block's checkpoint-named fp32 weights (norms are folded in place); x [S, L, H] block input.
    -> (QuantResult per linear, next block's input [S, L, H])."""
    qkv, gate_up, o, down = block.qkv, block.gate_up, block.o, block.down
    for name in qkv + gate_up + [o, down]:
        k = w[f"{name}.weight"].shape[1]
        if group_size > 0 and k % group_size:
            raise ValueError(f"AWQ needs in_features divisible by the group size: {name} has {k}, "
                             f"group_size {group_size}")
    c = settings.chunk
    n_sub = max(1, min(x.shape[0], settings.search_tokens // x.shape[1]))
    q_cfg = (group_size, sym)
    # One FP pass: every linear's input. Scaling is an exact identity in FP, so these stay valid until each
    # group's scale is applied, when its input is divided by the same scale.
    a = chunked(lambda t: block.attn_input(w, t), x, chunk=c)                      # [S, L, H]
    o_in = chunked(lambda t: block.attn_core(w, t), a, chunk=c)                    # [S, L, Hq*D]
    m = chunked(lambda t, u: block.mlp_input(w, t, u)[1], x, o_in, chunk=c)        # [S, L, H]
    d = chunked(lambda t: block.mlp_act(w, t), m, chunk=c)                         # [S, L, I]
    stats = {"a": _input_stats(a), "o": _input_stats(o_in), "m": _input_stats(m), "d": _input_stats(d)}

    s = _search_module(w, qkv, stats["a"], a[:n_sub], block.attn_output, q_cfg, c, settings)
    block.fold_norm(w, block.qkv_norm, s)
    _scale_inputs(w, qkv, s, stats["a"])
    v_name, v_rows = block.v_rows
    if v_rows.stop - v_rows.start == w[f"{o}.weight"].shape[1]:   # with GQA one v row feeds several o columns:
        s = _search_linear(w, [o], stats["o"], q_cfg, settings)  # AutoAWQ skips it
        _fold_rows(w, v_name, v_rows, s)
        _scale_inputs(w, [o], s, stats["o"])
    s = _search_module(w, gate_up, stats["m"], m[:n_sub], block.mlp_output, q_cfg, c, settings)
    block.fold_norm(w, block.gate_up_norm, s)
    _scale_inputs(w, gate_up, s, stats["m"])
    s = _search_linear(w, [down], stats["d"], q_cfg, settings)
    _fold_rows(w, *block.up_rows, s)
    _scale_inputs(w, [down], s, stats["d"])
    del a, o_in, m, d

    inputs = {name: stats["a"] for name in qkv} | {o: stats["o"]} | {name: stats["m"] for name in gate_up} | {
        down: stats["d"]}
    results = {}
    for name, (_, g) in inputs.items():
        weight = w[f"{name}.weight"]
        clip = None if name in NO_CLIP else _search_clip(weight, g, group_size, sym, settings)
        q, scales, zeros = quantize_rtn(weight, 4, group_size, sym, clip=clip, scale_dtype=torch.float16)
        results[name] = QuantResult(q, scales, zeros, None, w.get(f"{name}.bias"))
    if settings.propagate == "quantized":
        w = dict(w) | {f"{n}.weight": r.dequantize(group_size) for n, r in results.items()}
    elif settings.propagate != "fp":
        raise ValueError(f"AWQ propagate must be 'quantized' or 'fp', got {settings.propagate!r}")
    out = chunked(lambda t: block.forward(w, t), x, chunk=c)
    return results, out


def _input_stats(x: torch.Tensor) -> list[torch.Tensor]:
    """-> [mean |x| per channel [K], Gram X^T X [K, K]]; mutable so that folding can rescale both."""
    flat = x.reshape(-1, x.shape[-1])
    return [flat.abs().mean(0), gram(flat)]


def _weight_mean(w: dict, names: list[str], group_size: int) -> torch.Tensor:
    """AutoAWQ's w_mean: |W| normalized by its group max, averaged over every output row -> [K]."""
    weight = torch.cat([w[f"{n}.weight"] for n in names])                          # [N, K]
    n, k = weight.shape
    gs = k if group_size <= 0 else group_size
    grouped = weight.abs().view(n, -1, gs)
    return (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).view(n, k).mean(0)


def _candidates(x_mean: torch.Tensor, w_mean: torch.Tensor, n_grid: int):
    """Identity first, then s = x_mean^alpha / w_mean^(1 - alpha), normalized to a geometric mean of 1."""
    yield torch.ones_like(x_mean)
    for i in range(n_grid):
        alpha = i / n_grid
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        yield s / (s.max() * s.min()).sqrt()


def _scaled_fake_quant(w: dict, names: list[str], s: torch.Tensor, q_cfg) -> dict:
    """Weights as the model will see them: Q(W * s) / s for each scaled linear."""
    out = dict(w)
    for n in names:
        out[f"{n}.weight"] = fake_quantize(w[f"{n}.weight"] * s, *q_cfg) / s
    return out


def _search_module(w, names, stats, x_sub, forward, q_cfg, chunk, settings) -> torch.Tensor:
    """Scale minimizing the MSE of a module's output (attention or MLP) on the search subset."""
    target = chunked(lambda t: forward(w, t), x_sub, chunk=chunk)
    w_mean = _weight_mean(w, names, q_cfg[0])
    best, best_loss = None, float("inf")
    for s in _candidates(stats[0], w_mean, settings.n_grid):
        ww = _scaled_fake_quant(w, names, s, q_cfg)
        out = chunked(lambda t: forward(ww, t), x_sub, chunk=chunk)
        loss = float((out - target).pow(2).mean())
        if best is None:
            rtn_loss = loss
        if loss < best_loss:
            best, best_loss = s, loss
    logger.debug("awq scale %s: loss %.3g of RTN's", names, best_loss / max(rtn_loss, 1e-30))
    return best


def _search_linear(w, names, stats, q_cfg, settings) -> torch.Tensor:
    """Scale minimizing a linear layer's output error over every token: tr(dW G dW^T), G = X^T X."""
    x_mean, g = stats
    w_mean = _weight_mean(w, names, q_cfg[0])
    best, best_loss = None, float("inf")
    for s in _candidates(x_mean, w_mean, settings.n_grid):
        ww = _scaled_fake_quant(w, names, s, q_cfg)
        loss = sum(float(((ww[f"{n}.weight"] - w[f"{n}.weight"]) @ g).mul_(ww[f"{n}.weight"] - w[f"{n}.weight"])
                         .sum()) for n in names)
        if best is None:
            rtn_loss = loss
        if loss < best_loss:
            best, best_loss = s, loss
    logger.debug("awq scale %s: loss %.3g of RTN's", names, best_loss / max(rtn_loss, 1e-30))
    return best


def _scale_inputs(w: dict, names: list[str], s: torch.Tensor, stats: list[torch.Tensor]) -> None:
    """The other half of a fold: the linears' input columns *= s; the cached input statistics become those of
    x / s."""
    for n in names:
        w[f"{n}.weight"] = w[f"{n}.weight"] * s
    stats[0] = stats[0] / s
    stats[1] = stats[1] / (s[:, None] * s[None, :])


def _fold_rows(w: dict, name: str, rows: slice, s: torch.Tensor) -> None:
    """Linear `name`'s output rows `rows` (and their bias) /= s: they produce the scaled linears' input."""
    for key in (f"{name}.weight", f"{name}.bias"):
        if key in w:
            t = w[key].clone()
            t[rows] = t[rows] / (s[:, None] if t.dim() == 2 else s)
            w[key] = t


def _search_clip(weight: torch.Tensor, g: torch.Tensor, group_size: int, sym: bool, settings: AWQSettings
                 ) -> torch.Tensor:
    n, k = weight.shape
    gs = k if group_size <= 0 else group_size
    blocks = torch.stack([g[i:i + gs, i:i + gs] for i in range(0, k, gs)])              # [G, gs, gs]
    ratios = [1 - i / settings.n_grid for i in range(int(settings.max_shrink * settings.n_grid))]
    clip, err = search_clip(weight, blocks, group_size, sym, ratios, settings.clip_2d)
    logger.debug("awq clip: error %.3g of the unclipped", err)
    return clip
