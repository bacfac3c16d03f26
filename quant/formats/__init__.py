"""Checkpoint format readers and writers. `load_quant_config` finds a checkpoint's INT4 format; its QuantConfig
builds each linear layer and converts the checkpoint's tensors into the one internal layout
(kernels/matmul/reference.py)."""
import json
from pathlib import Path

from quant_serve.quant.formats.awq import AWQConfig, awq_quantization_config, write_awq_gemm
from quant_serve.quant.formats.base import Int4Weights, QuantConfig
from quant_serve.quant.formats.compressed_tensors import (CompressedTensorsConfig, ct_quantization_config,
                                                          write_pack_quantized)
from quant_serve.quant.formats.gptq import GPTQConfig, gptq_quantization_config, write_gptq

CONFIG_CLASSES = {"awq": AWQConfig, "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig}
# What users type (vLLM names included) -> our method name.
_ALIASES = {"awq_marlin": "awq", "auto_awq": "awq", "gptq_marlin": "gptq", "auto_gptq": "gptq",
            "compressed_tensors": "compressed-tensors"}

__all__ = ["AWQConfig", "CompressedTensorsConfig", "GPTQConfig", "Int4Weights", "QuantConfig", "load_quant_config",
           "find_quantization_config", "awq_quantization_config", "ct_quantization_config",
           "gptq_quantization_config", "write_awq_gemm", "write_gptq", "write_pack_quantized"]


def normalize_method(name: str) -> str:
    name = str(name).strip().lower()
    return _ALIASES.get(name, name)


def find_quantization_config(hf_config: dict, model_dir: str | Path | None) -> tuple[dict | None, str]:
    """-> (raw quantization config, where it was found) or (None, "") for an unquantized model. A side file
    (quant_config.json, quantize_config.json) that names another method than config.json is an error."""
    found, where = None, ""
    config_file = str(Path(model_dir) / "config.json") if model_dir is not None else "config.json"
    for place, cfg in ((config_file, hf_config), (f"{config_file} text_config", hf_config.get("text_config") or {})):
        for key in ("quantization_config", "compression_config"):
            if found is None and cfg.get(key):
                if not isinstance(cfg[key], dict):
                    raise ValueError(f"{place} {key} must be an object like {{\"quant_method\": \"awq\", ...}}, "
                                     f"found {cfg[key]!r}")
                found, where = dict(cfg[key]), f"{place} {key}"
    for path, raw in _side_files(model_dir):
        if found is None:
            return raw, str(path)
        if "quant_method" in found and normalize_method(raw["quant_method"]) != normalize_method(
                found["quant_method"]):
            raise ValueError(f"{path} says quant_method {raw['quant_method']!r} but {where} says "
                             f"{found['quant_method']!r}: the checkpoint mixes two formats")
    return found, where


def _side_files(model_dir: str | Path | None) -> list[tuple[Path, dict]]:
    out = []
    for name, implied in (("quant_config.json", "awq"), ("quantize_config.json", "gptq")):
        path = Path(model_dir) / name if model_dir is not None else None
        if path is None or not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, found {type(raw).__name__}")
        # Old AutoAWQ / AutoGPTQ files carry no quant_method: the file name says which tool wrote it.
        raw.setdefault("quant_method", implied)
        out.append((path, raw))
    return out


def load_quant_config(hf_config: dict, model_dir: str | Path | None, tensor_names: set[str] | None,
                      override: str | None = None) -> QuantConfig | None:
    """The checkpoint's QuantConfig, or None for an unquantized model.

    tensor_names: every key of the safetensors headers (None for dummy weights: then the config alone decides).
    override: `--quantization awq|gptq|compressed-tensors|none`; it must agree with the checkpoint.
    """
    raw, source = find_quantization_config(hf_config, model_dir)
    wanted = normalize_method(override) if override else None
    if raw is None:
        if wanted not in (None, "none"):
            raise ValueError(f"--quantization {override} was given, but the checkpoint has no quantization_config "
                             "(config.json, quant_config.json or quantize_config.json)")
        return None
    if "quant_method" not in raw:
        raise ValueError(f"{source} has no quant_method (supported: {', '.join(CONFIG_CLASSES)})")
    method = normalize_method(raw["quant_method"])
    if method not in CONFIG_CLASSES:
        raise ValueError(f"unsupported quant_method {raw['quant_method']!r} in {source} "
                         f"(supported: {', '.join(CONFIG_CLASSES)})")
    if wanted is not None and wanted != method:
        raise ValueError(f"--quantization {override} disagrees with the checkpoint, which {source} says is "
                         f"{method}; drop the flag or pass --quantization {method}")
    names = frozenset(tensor_names) if tensor_names is not None else None
    return CONFIG_CLASSES[method].from_dict(raw, source, names)
