"""Per-layer K and V scales for an fp8 KV cache: where they come from, the calibration file, the first-forward check.

The cache stores fp8(clamp(x / scale)) and reads fp8 * scale (kernels/attention/reference.py). Sources, in the order
`--kv-scale-source auto` tries them:
  checkpoint    scalars in the safetensors (the names vLLM reads; see parse_kv_scale_name), all layers present
  file          `kv_scales.json` next to the weights, written by write_kv_scales from calibrate_kv_scales
                (engine/worker/kv_calibration.py)
  first-prompt  computed once, inside the first forward, from that step's own K and V (before they are stored)
  unit          1.0: only when asked for; warns
Rule for computed scales: scale = amax(|x|) * KV_SCALE_MARGIN / fp8_max, so the largest value seen lands one
binade below the fp8 maximum. Floats keep the same relative precision across their range, so the headroom costs
almost nothing, and later tokens up to twice the amax seen still fit unclamped.

kv_scales.json: {"format": "quant-serve-kv-scales", "version": 1, "dtype_max": 448.0, "margin": 2.0,
"num_tokens": N, "layers": {"0": {"k_scale": s, "v_scale": s, "k_amax": a, "v_amax": a}, ...}}. The scales target
an fp8 format whose maximum is dtype_max; a cache format with a smaller maximum scales them up by the ratio.
"""
import json
import logging
import os
import re
from pathlib import Path

import torch

logger = logging.getLogger("quant_serve")

FORMAT = "quant-serve-kv-scales"
VERSION = 1
FILE_NAME = "kv_scales.json"
KV_SCALE_MARGIN = 2.0
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)     # 448
SOURCES = ("auto", "checkpoint", "file", "first-prompt", "unit")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parse_kv_scale_name(name: str) -> tuple[int, tuple[str, ...]] | None:
    """Checkpoint tensor name -> (layer, which of "k"/"v" it sets), or None when it is no attention scale.
    A scale we do not use (q_scale, prob_scale, q_proj.output_scale) gives (layer, ())."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("k_scale", "v_scale", "kv_scale", "q_scale", "prob_scale", "output_scale"):
        return None
    match = _LAYER.search(name)
    if match is None or "self_attn" not in module:
        return None
    layer = int(match.group(1))
    if leaf == "output_scale":      # compressed-tensors: the k/v projection's output is what the cache holds
        proj = module.rpartition(".")[2]
        return layer, {"k_proj": ("k",), "v_proj": ("v",)}.get(proj, ())
    return layer, {"k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v")}.get(leaf, ())


def checkpoint_scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        logger.warning("%s has %d elements; the KV cache uses one scale per layer, taking the largest",
                       name, tensor.numel())
    return float(tensor.float().max())


def scale_from_amax(amax: float, fp8_max: float, margin: float = KV_SCALE_MARGIN) -> float:
    return amax * margin / fp8_max if amax > 0 else 1.0


# ---- the calibration file -------------------------------------------------------------------------------
def make_kv_scales(k_amax: list[float], v_amax: list[float], num_tokens: int, dtype_max: float = E4M3_MAX,
                   margin: float = KV_SCALE_MARGIN) -> dict:
    layers = {str(i): {"k_scale": scale_from_amax(k, dtype_max, margin),
                       "v_scale": scale_from_amax(v, dtype_max, margin), "k_amax": k, "v_amax": v}
              for i, (k, v) in enumerate(zip(k_amax, v_amax))}
    return {"format": FORMAT, "version": VERSION, "dtype_max": dtype_max, "margin": margin, "num_tokens": num_tokens,
            "layers": layers}


def validate_kv_scales(data: dict, where: str, num_layers: int | None = None) -> None:
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} file (format {found!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{where}: version {data.get('version')!r} is not supported (expected {VERSION})")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers or not all(str(k).isdigit() for k in layers):
        raise ValueError(f"{where}: 'layers' must map layer indices to {{k_scale, v_scale}}")
    for key, entry in layers.items():
        for name in ("k_scale", "v_scale"):
            value = entry.get(name) if isinstance(entry, dict) else None
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"{where}: layer {key} {name} must be a positive number, got {value!r}")
    if num_layers is not None and sorted(layers, key=int) != [str(i) for i in range(num_layers)]:
        raise ValueError(f"{where}: has scales for layers {sorted(layers, key=int)}, the model has {num_layers}")


def write_kv_scales(model_dir, scales: dict) -> Path:
    """Write `scales` (from kv_calibration.calibrate_kv_scales) to model_dir/kv_scales.json atomically."""
    path = Path(model_dir) / FILE_NAME
    validate_kv_scales(scales, str(path))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(scales, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_kv_scales(model_dir, num_layers: int) -> dict | None:
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from e
    validate_kv_scales(data, str(path), num_layers)
    return data


# ---- choosing the scales at startup -------------------------------------------------------------------
def resolve_kv_scales(source: str, kv_dtype: torch.dtype, model_dir, checkpoint_scales: dict[int, dict],
                      num_layers: int) -> list[tuple[float, float]] | None:
    """Per-layer (k_scale, v_scale), or None to compute them in the first forward."""
    if source not in SOURCES:
        raise ValueError(f"unknown kv scale source {source!r} (supported: {', '.join(SOURCES)})")
    if kv_dtype not in FP8_DTYPES:
        return [(1.0, 1.0)] * num_layers
    fp8_max = float(torch.finfo(kv_dtype).max)
    name = str(kv_dtype).replace("torch.", "")
    if source == "unit":
        logger.warning("KV cache %s with scales forced to 1.0 (--kv-scale-source unit): K/V beyond +-%g are "
                       "clamped", name, fp8_max)
        return [(1.0, 1.0)] * num_layers
    if source in ("auto", "checkpoint"):
        complete = all(len(checkpoint_scales.get(i, {})) == 2 for i in range(num_layers))
        if complete:
            logger.info("KV cache %s: K/V scales from the checkpoint", name)
            return [(checkpoint_scales[i]["k_scale"], checkpoint_scales[i]["v_scale"]) for i in range(num_layers)]
        have = sorted(i for i, s in checkpoint_scales.items() if len(s) == 2)
        if source == "checkpoint" or checkpoint_scales:
            message = (f"the checkpoint has K and V scales for {len(have)} of {num_layers} layers"
                       + (f" ({have})" if have else ""))
            if source == "checkpoint":
                raise ValueError(f"--kv-scale-source checkpoint: {message}")
            logger.warning("%s; not using them", message)
    if source in ("auto", "file"):
        data = read_kv_scales(model_dir, num_layers)
        if data is not None:
            factor = max(1.0, float(data.get("dtype_max", E4M3_MAX)) / fp8_max)
            logger.info("KV cache %s: K/V scales from %s (calibrated on %s tokens)", name,
                        Path(model_dir) / FILE_NAME, data.get("num_tokens", "?"))
            layers = data["layers"]
            return [(layers[str(i)]["k_scale"] * factor, layers[str(i)]["v_scale"] * factor)
                    for i in range(num_layers)]
        if source == "file":
            raise ValueError(f"--kv-scale-source file: no {FILE_NAME} in {model_dir} (write one with "
                             "engine.kv_scales.write_kv_scales or the calibrate command)")
    logger.info("KV cache %s: K/V scales will be computed from the first prompt (amax x %g / %g)", name,
                KV_SCALE_MARGIN, fp8_max)
    return None


# ---- observing K and V --------------------------------------------------------------------------------
class KVRangeObserver:
    """Called by the attention layers with each step's new K and V before they are stored
    (AttentionMetadata.kv_observer). Records amax(|k|), amax(|v|) per layer; with set_scales_for=fp8_max it
    also sets the layer's scales from them right before the store (the first-prompt rule)."""

    def __init__(self, attention_layers, set_scales_for: float | None = None, margin: float = KV_SCALE_MARGIN):
        self.layer_of = {id(attn.k_scale): i for i, attn in enumerate(attention_layers)}
        self.k_amax = [0.0] * len(attention_layers)
        self.v_amax = [0.0] * len(attention_layers)
        self.num_tokens = 0
        self.set_scales_for = set_scales_for
        self.margin = margin

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        i = self.layer_of[id(k_scale)]
        if i == 0:
            self.num_tokens += k.shape[0]
        if k.numel():
            self.k_amax[i] = max(self.k_amax[i], float(k.abs().max()))
            self.v_amax[i] = max(self.v_amax[i], float(v.abs().max()))
        if self.set_scales_for is not None:
            k_scale.fill_(scale_from_amax(self.k_amax[i], self.set_scales_for, self.margin))
            v_scale.fill_(scale_from_amax(self.v_amax[i], self.set_scales_for, self.margin))

    def report(self, attention_layers, kv_dtype: torch.dtype) -> None:
        """After the first forward: log computed scales, and warn for every layer whose K or V went past the fp8
        range at its scale (those values were clamped: an unscaled or badly scaled cache)."""
        fp8_max = float(torch.finfo(kv_dtype).max)
        name = str(kv_dtype).replace("torch.", "")
        k_scales = [float(a.k_scale) for a in attention_layers]
        v_scales = [float(a.v_scale) for a in attention_layers]
        if self.set_scales_for is not None:
            logger.info("KV cache %s: scales from the first prompt (%d tokens): k_scale %.4g..%.4g, "
                        "v_scale %.4g..%.4g", name, self.num_tokens, min(k_scales), max(k_scales), min(v_scales),
                        max(v_scales))
        for i, (ka, va, ks, vs) in enumerate(zip(self.k_amax, self.v_amax, k_scales, v_scales)):
            for which, amax, scale in (("k", ka, ks), ("v", va, vs)):
                if amax > fp8_max * scale:
                    logger.warning("KV cache %s: layer %d |%s| amax %.4g exceeds the fp8 range at %s_scale %.4g "
                                   "(max %.4g): values are clamped; calibrate KV scales (kv_scales.json) or use "
                                   "--kv-scale-source first-prompt", name, i, which, amax, which, scale,
                                   fp8_max * scale)
