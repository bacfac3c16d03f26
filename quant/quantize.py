"""The quantization driver: one decoder block at a time on the compute device, weights read lazily from the source
checkpoint, standard INT4 checkpoints (AWQ gemm, GPTQ v1/v2, compressed-tensors) written atomically.

The caller (server/cli/quantize.py) reads the source config and safetensors through engine/ helpers and hands
in a SourceModel of plain tensors and callables, with the engine's decoder as the CalibModel (quant/block.py) that
AWQ and GPTQ observe: quant does not import engine.
"""
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from quant_serve.quant.awq import AWQSettings, awq_block
from quant_serve.quant.block import CalibBlock, CalibModel, gram
from quant_serve.quant.formats import (awq_quantization_config, ct_quantization_config, gptq_quantization_config,
                                       write_awq_gemm, write_gptq, write_pack_quantized)
from quant_serve.quant.gptq import GPTQSettings, gptq_block, gptq_quantize
from quant_serve.quant.output import ShardWriter, atomic_output_dir
from quant_serve.quant.rtn import QuantResult, quantize_rtn

logger = logging.getLogger("quant_serve")

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj",
           "self_attn.qkv_proj", "mlp.gate_up_proj"]          # Phi-3 checkpoints store these two fused
METHODS = ("rtn", "awq", "gptq")
FORMATS = ("awq", "gptq", "gptq_v2", "compressed-tensors")
DEFAULT_SYM = {"rtn": False, "awq": False, "gptq": True}


@dataclass
class QuantizeConfig:
    method: str = "awq"
    group_size: int = 128
    sym: bool | None = None               # None: the method's default (rtn, awq asym; gptq sym)
    format: str | None = None             # None: awq for asym rtn/awq, gptq (v1) for sym, gptq_v2 for asym gptq
    device: str = "cpu"
    awq: AWQSettings = field(default_factory=AWQSettings)
    gptq: GPTQSettings = field(default_factory=GPTQSettings)
    max_shard_bytes: int = 4 * 2**30
    lm_head: bool = False                 # also the output head (quantize_head: GPTQ with gptq, else RTN)

    def resolved(self) -> tuple[bool, str]:
        """-> (sym, format), or ValueError naming the flag to change."""
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        sym = DEFAULT_SYM[self.method] if self.sym is None else self.sym
        fmt = self.format or ("awq" if self.method != "gptq" and not sym else "gptq" if sym else "gptq_v2")
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
        if fmt == "gptq" and not sym:
            raise ValueError("GPTQ v1 (--format gptq) cannot store asymmetric zeros safely (a zero point of 0 "
                             "wraps to -1); use --format gptq_v2, awq or compressed-tensors, or --sym")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(f"--group-size must be -1 or a positive multiple of 8, got {self.group_size}")
        act_order = self.method == "gptq" and self.gptq.act_order and not self.gptq.static_groups
        if act_order and fmt in ("awq", "compressed-tensors"):
            raise ValueError(f"--format {fmt} cannot store act-order groups (a permuted g_idx); use --format gptq "
                             "or gptq_v2, or --static-groups (act-order with groups fixed in the original order)")
        if self.lm_head and fmt == "awq":
            raise ValueError("--lm-head: AutoAWQ's format keeps lm_head in FP16 (readers would not expect it); use "
                             "--format gptq, gptq_v2 or compressed-tensors")
        return sym, fmt


@dataclass
class SourceModel:
    """The unquantized checkpoint, read lazily."""
    num_layers: int
    config: dict                          # raw config.json
    tensor_names: list[str]
    read: Callable[[str], torch.Tensor]   # name -> tensor as stored (CPU)
    extra_files: list[Path] = field(default_factory=list)   # tokenizer, chat template, generation config
    source_dir: Path | None = None        # where it lives: the output may never be, hold or lie inside it
    model: CalibModel | None = None       # its forward, block by block (awq and gptq calibrate on it)


def quantize_model(source: SourceModel, calib: torch.Tensor | None, cfg: QuantizeConfig, out_dir: str | Path,
                   overwrite: bool = False, show_progress: bool = True,
                   results_sink: dict[str, QuantResult] | None = None,
                   finish: Callable[[Path], None] | None = None) -> Path:
    """Quantize every decoder-block Linear; calib [S, L] token ids (needed by awq and gptq).
    results_sink: filled with each module's QuantResult (on CPU), for tests. finish: called with the complete
    temporary checkpoint before it becomes OUT_DIR (to add files that need the quantized model, kv_scales.json)."""
    sym, fmt = cfg.resolved()
    if source.config.get("quantization_config"):
        raise ValueError("the source model is already quantized (config.json has a quantization_config)")
    if cfg.method != "rtn" and calib is None:
        raise ValueError(f"{cfg.method} needs calibration text")
    if cfg.method != "rtn" and source.model is None:
        raise ValueError(f"--method {cfg.method} calibrates on the model's forward, which this source does not "
                         "provide (SourceModel.model); use --method rtn")
    if cfg.lm_head and "lm_head.weight" not in source.tensor_names:
        raise ValueError("--lm-head: this model ties lm_head to the embedding table (no lm_head.weight); "
                         "quantizing it would need an untied copy of the table")
    device, start = torch.device(cfg.device), time.time()
    model_dtype = source.read("model.embed_tokens.weight").dtype
    x = None
    if cfg.method != "rtn":
        x = source.model.embed(calib, device)                                           # [S, L, H]
    info = {"source": str(source.source_dir) if source.source_dir else None, "method": cfg.method,
            "group_size": cfg.group_size, "sym": sym, "format": fmt}
    with atomic_output_dir(out_dir, overwrite, source.source_dir, info) as tmp:
        writer = ShardWriter(tmp, cfg.max_shard_bytes)
        bar = tqdm(range(source.num_layers), desc=f"Quantizing ({cfg.method}, g{cfg.group_size})", unit="block",
                   disable=not show_progress)
        for i in bar:
            prefix = f"model.layers.{i}."
            stored = {n[len(prefix):]: source.read(n) for n in source.tensor_names if n.startswith(prefix)}
            w = {k: v.to(device, torch.float32) for k, v in stored.items() if not k.endswith("rotary_emb.inv_freq")}
            block = source.model.block(i, calib.shape[1], device) if cfg.method != "rtn" else None
            results, x = quantize_block(w, x, block, cfg, sym)
            for name, res in results.items():
                res = QuantResult(*(t.cpu() if t is not None else None
                                    for t in (res.q, res.scales, res.zeros, res.g_idx, res.bias)))
                if results_sink is not None:
                    results_sink[prefix + name] = res
                for suffix, t in write_module(res, fmt, cfg.group_size, model_dtype).items():
                    writer.add(f"{prefix}{name}.{suffix}", t)
            for key, t in w.items():
                if key.rsplit(".", 1)[0] not in results:        # norms, AWQ-folded ones included
                    writer.add(prefix + key, t.to("cpu", stored[key].dtype))
            del w, results
        if cfg.lm_head:
            res = quantize_head(source, x, cfg, sym, device)
            if results_sink is not None:
                results_sink["lm_head"] = res
            for suffix, t in write_module(res, fmt, cfg.group_size, model_dtype).items():
                writer.add(f"lm_head.{suffix}", t)
        for name in source.tensor_names:
            if name == "lm_head.weight" and cfg.lm_head:
                continue
            if not name.startswith("model.layers.") and not name.endswith("rotary_emb.inv_freq"):
                writer.add(name, source.read(name))
        writer.close()
        config = dict(source.config) | {"quantization_config": quantization_config(cfg, sym, fmt)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in source.extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        if finish is not None:
            finish(tmp)
    logger.info("quantized %d blocks (%s, %s, g%d) in %.1f s -> %s", source.num_layers, cfg.method,
                "sym" if sym else "asym", cfg.group_size, time.time() - start, out_dir)
    return Path(out_dir)


def quantize_head(source: SourceModel, x: torch.Tensor | None, cfg: QuantizeConfig, sym: bool, device
                  ) -> QuantResult:
    """lm_head -> its QuantResult on the CPU. --method gptq: GPTQ on the final norm of the quantized model's last
    hidden states x [S, L, H] (the calibration text's), as GPTQModel does; rtn and awq: round-to-nearest (AWQ's
    scales would have to fold into the final norm, which AutoAWQ's format never does)."""
    weight = source.read("lm_head.weight").to(device, torch.float32)
    if cfg.method == "gptq":
        h = source.model.final_norm(x)
        res = gptq_quantize(weight, gram(h) * (2 / (h.numel() // h.shape[-1])), cfg.group_size, sym, cfg.gptq)
    else:
        q, s, z = quantize_rtn(weight, 4, cfg.group_size, sym, scale_dtype=torch.float16)
        res = QuantResult(q, s, z)
    return QuantResult(*(t.cpu() if t is not None else None for t in (res.q, res.scales, res.zeros, res.g_idx)))


def quantize_block(w: dict, x: torch.Tensor | None, block: CalibBlock | None, cfg: QuantizeConfig, sym: bool
                   ) -> tuple[dict[str, QuantResult], torch.Tensor | None]:
    if cfg.method == "awq":
        return awq_block(w, x, block, cfg.group_size, sym, cfg.awq)
    if cfg.method == "gptq":
        return gptq_block(w, x, block, cfg.group_size, sym, cfg.gptq)
    results = {}
    for name in LINEARS:
        if f"{name}.weight" in w:
            q, s, z = quantize_rtn(w[f"{name}.weight"], 4, cfg.group_size, sym, scale_dtype=torch.float16)
            results[name] = QuantResult(q, s, z, None, w.get(f"{name}.bias"))
    return results, x


def write_module(res: QuantResult, fmt: str, group_size: int, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    args = (res.q, res.scales, res.zeros, group_size, res.g_idx, res.bias)
    if fmt == "awq":
        return write_awq_gemm(*args)
    if fmt in ("gptq", "gptq_v2"):
        return write_gptq(*args, checkpoint_format=fmt)
    return write_pack_quantized(*args, scale_dtype=model_dtype)


def quantization_config(cfg: QuantizeConfig, sym: bool, fmt: str) -> dict:
    act_order = cfg.method == "gptq" and cfg.gptq.act_order
    if fmt == "awq":
        return awq_quantization_config(cfg.group_size)
    if fmt == "compressed-tensors":
        out = ct_quantization_config(cfg.group_size, sym, ignore=[] if cfg.lm_head else None)
        if act_order:                          # static groups only (resolved() refuses the rest)
            out["config_groups"]["group_0"]["weights"]["actorder"] = "static"
        return out
    static = cfg.gptq.static_groups
    return gptq_quantization_config(cfg.group_size, sym, act_order and not static, fmt) | {
        "damp_percent": cfg.gptq.damp_percent, "static_groups": act_order and static,
        "true_sequential": cfg.method == "gptq", "lm_head": cfg.lm_head}
