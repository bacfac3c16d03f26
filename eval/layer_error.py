"""Per-layer error of the quantized linears: ||W_q x - W x|| / ||W x|| on calibration activations.

Forward hooks on the reference model's dense linears capture each input x and the reference output W x while the
reference scores a few windows; the hook feeds the same x to the candidate's matching QuantLinear (its real forward,
kernels included). Using the reference's activations for both isolates each layer's own error from the error that
accumulates through earlier layers. Merged layers (qkv, gate_up) are split back into the checkpoint's modules.

AWQ-style checkpoints fold smoothing scales into the op before a linear (the norm before qkv / gate_up, up_proj's
rows before down_proj, v_proj's rows before o_proj when shapes allow), so their linears expect a rescaled input.
Without undoing that, the error measures the fold, not the quantization. A norm fold is exact and known (the ratio
of the two models' norm weights). A linear-to-linear fold s is recovered, only in layers whose norms show folding,
as the per-row least-squares gain of the producer's weights (up_proj ~ W_up / s): the consumer is then fed x / s
and the producer's output is multiplied by s. A damaged consumer (e.g. down_proj scales x4) is not absorbed by this.
"""
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from quant_serve.eval.data import Window
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.layers.parts import PartsLinear
from quant_serve.quant.layers.w8 import W8Linear

FOLD_TOLERANCE = 1e-3      # norm weights differing by more than this (relative) mean the checkpoint folded scales


@dataclass
class LayerError:
    name: str                 # checkpoint module name, e.g. model.layers.5.mlp.down_proj
    rel_error: float          # sqrt(sum ||W_q x - W x||^2 / sum ||W x||^2) over all tokens
    num_tokens: int
    compensated: bool = False  # folded smoothing scales were undone before comparing


@dataclass
class _Accum:
    name: str
    err2: float = 0.0
    ref2: float = 0.0
    tokens: int = 0


@dataclass
class _Fold:
    in_scale: torch.Tensor | None = None    # multiplies the reference input before the candidate linear
    out_scale: torch.Tensor | None = None   # multiplies the candidate output


def shard_names(module_name: str, module: torch.nn.Module) -> list[str]:
    """Checkpoint names of the output shards of a (possibly merged) QuantLinear."""
    if getattr(module, "parts", None) is not None:
        return [n for part in module.parts for n in shard_names(module_name, part)]
    prefixes = getattr(module, "source_prefixes", None) or []
    if len(prefixes) == len(module.output_sizes) and not prefixes[0].startswith("shard "):
        return list(prefixes)
    if len(module.output_sizes) == 1:
        return [module_name]
    return [f"{module_name}[{i}]" for i in range(len(module.output_sizes))]


def quantized_pairs(reference_model, candidate_model) -> list[tuple[str, DenseLinear, QuantLinear]]:
    cand = dict(candidate_model.named_modules())
    pairs = []
    for name, ref_module in reference_model.named_modules():
        if isinstance(ref_module, DenseLinear) and isinstance(cand.get(name), (QuantLinear, W8Linear, PartsLinear)):
            q = cand[name]
            if list(q.output_sizes) != list(ref_module.output_sizes) or q.in_features != ref_module.in_features:
                raise ValueError(f"{name}: candidate shape {q.in_features}x{q.output_sizes} differs from the "
                                 f"reference's {ref_module.in_features}x{ref_module.output_sizes}")
            pairs.append((name, ref_module, q))
    return pairs


def _row_gain(ref: DenseLinear, cand: QuantLinear, rows: slice, in_scale: torch.Tensor | None) -> torch.Tensor:
    """Per output row r minimizing ||r * W_q[rows] diag(in_scale) - W[rows]||: the fold s on those rows."""
    w_q = cand.dequantized_weight()[rows].float().cpu()
    if in_scale is not None:
        w_q = w_q * in_scale.float().cpu()
    w = ref.weight[rows].float().cpu()
    return (w * w_q).sum(1) / (w_q * w_q).sum(1).clamp_min(1e-30)


def find_folds(reference_model, candidate_model) -> dict[str, _Fold]:
    """Module name -> compensation, for the decoder layout (layers.i.{input,post_attention}_layernorm, ...)."""
    ref, cand = dict(reference_model.named_modules()), dict(candidate_model.named_modules())
    folds: dict[str, _Fold] = {}
    norms = ("input_layernorm", "post_attention_layernorm")
    for name in ref:
        layer = name.rsplit(".", 1)[0]
        if not name.endswith(".input_layernorm") or not all(f"{layer}.{n}" in m for n in norms for m in (ref, cand)):
            continue
        folded = False
        for norm, linear in zip(norms, ("self_attn.qkv_proj", "mlp.gate_up_proj")):
            w_ref, w_cand = ref[f"{layer}.{norm}"].weight.float(), cand[f"{layer}.{norm}"].weight.float()
            ratio = torch.where(w_ref == 0, torch.ones_like(w_ref), w_cand / w_ref)
            folds[f"{layer}.{linear}"] = _Fold(in_scale=ratio)
            folded |= bool((ratio - 1).abs().max() > FOLD_TOLERANCE)
        if not folded:
            continue
        for producer, shard, consumer in (("mlp.gate_up_proj", 1, "mlp.down_proj"),
                                          ("self_attn.qkv_proj", 2, "self_attn.o_proj")):
            p_ref, p_cand = ref.get(f"{layer}.{producer}"), cand.get(f"{layer}.{producer}")
            c_cand = cand.get(f"{layer}.{consumer}")
            if not isinstance(p_cand, QuantLinear) or not isinstance(c_cand, QuantLinear):
                continue
            sizes = p_cand.output_sizes
            if shard >= len(sizes) or sizes[shard] != c_cand.in_features:
                continue          # e.g. GQA: v_proj's rows do not map one-to-one to o_proj's inputs (no fold)
            start = sum(sizes[:shard])
            fold = folds[f"{layer}.{producer}"]
            s = _row_gain(p_ref, p_cand, slice(start, start + sizes[shard]), fold.in_scale)
            out = torch.ones(sum(sizes))
            out[start:start + sizes[shard]] = s
            fold.out_scale = out
            folds[f"{layer}.{consumer}"] = _Fold(in_scale=1.0 / s)
    return folds


def layer_errors(reference_engine, candidate_engine, windows: list[Window], desc: str) -> list[LayerError]:
    """Relative output error per quantized linear of the candidate, worst first. [] if nothing is quantized."""
    pairs = quantized_pairs(reference_engine.model, candidate_engine.model)
    if not pairs or not windows:
        return []
    folds = find_folds(reference_engine.model, candidate_engine.model)
    accums: list[tuple[list[_Accum], bool]] = []
    handles = []
    for name, ref_module, q_module in pairs:
        shards = [_Accum(n) for n in shard_names(name, q_module)]
        fold = folds.get(name, _Fold())
        compensated = any(t is not None and bool((t - 1).abs().max() > FOLD_TOLERANCE)
                          for t in (fold.in_scale, fold.out_scale))
        accums.append((shards, compensated))
        handles.append(ref_module.register_forward_hook(
            _make_hook(q_module, shards, ref_module.output_sizes, fold if compensated else _Fold())))
    try:
        for window in tqdm(windows, desc=f"layer error {desc}", unit="win"):
            reference_engine.score(window.tokens)
    finally:
        for h in handles:
            h.remove()
    errors = [LayerError(a.name, math.sqrt(a.err2 / a.ref2) if a.ref2 > 0 else float("nan"), a.tokens, comp)
              for shards, comp in accums for a in shards]
    return sorted(errors, key=lambda e: -e.rel_error if not math.isnan(e.rel_error) else 0.0)


def _make_hook(q_module: QuantLinear, shards: list[_Accum], output_sizes: list[int], fold: _Fold):
    in_scale = None if fold.in_scale is None else fold.in_scale.to(q_module.device, torch.float32)
    out_scale = None if fold.out_scale is None else fold.out_scale.to(torch.float64)

    def hook(module, inputs, output):
        x = inputs[0].to(q_module.device)
        if in_scale is not None:
            x = x.float() * in_scale
        y_q = q_module(x.to(q_module.dtype)).to(output.device, torch.float64)
        if out_scale is not None:
            y_q = y_q * out_scale.to(y_q.device)
        y = output.to(torch.float64)
        for acc, d, r in zip(shards, (y_q - y).split(output_sizes, dim=-1), y.split(output_sizes, dim=-1)):
            acc.err2 += float(d.pow(2).sum())
            acc.ref2 += float(r.pow(2).sum())
            acc.tokens += int(x.shape[0])
    return hook
