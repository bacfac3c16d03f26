"""What a checkpoint directory must hold before a model is built from it: readable JSON objects, config values a
decoder can have, exactly the weight files the index lists, and tensors whose dtype fits and which hold no NaN or
Inf. Every refusal is one ValueError naming the file (and the tensor)."""
import json
import logging
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from quant_serve.quant.linear_dense import FLOAT_DTYPES

logger = logging.getLogger("quant_serve")

INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_CONFIG_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "max_position_embeddings")
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}
# the config.json sizes the engine divides by or sizes tensors with; the optional ones may be null
HF_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object, or a ValueError naming the file and the problem."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, found {type(value).__name__} {_short(value)}")
    return value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_raw_config(raw: dict, config_file: Path) -> None:
    """The shape of config.json before transformers reads it (AutoConfig fails with tracebacks on these)."""
    for key in ("quantization_config", "compression_config"):
        value = raw.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{config_file}: {key} must be an object like {{\"quant_method\": \"awq\", "
                             f"\"bits\": 4, ...}}, found {type(value).__name__} {_short(value)}")
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{config_file}: architectures must be a list of names, found {_short(archs)}")
    for key in HF_SIZE_FIELDS:          # before transformers, whose errors for these span many lines
        if key in raw and not (raw[key] is None and key in _OPTIONAL_SIZES):
            check_size(key, raw[key], config_file)


def check_size(name: str, value, config_file: Path) -> None:
    """A count or size (heads, layers, hidden size, vocabulary...) must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{config_file}: {name} must be a positive integer, got {_short(value)}")


def check_model_config(cfg, config_file: Path, head_dim_given: bool) -> None:
    """Values no decoder can have (a ModelConfig built from config_file)."""
    for field in _CONFIG_INTS:
        check_size(_HF_NAMES.get(field, field), getattr(cfg, field), config_file)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{config_file}: num_attention_heads {cfg.num_heads} is not a multiple of "
                         f"num_key_value_heads {cfg.num_kv_heads}")
    if not head_dim_given and cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"{config_file}: hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads "
                         f"{cfg.num_heads} (and no head_dim is given)")
    for field in ("rms_norm_eps", "rope_theta"):
        value = getattr(cfg, field)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{config_file}: {field} must be a positive number, got {value!r}")


def list_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index lists (every one present, no other shard beside
    them), or every *.safetensors in the directory."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no weight_map object of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
        for extra in sorted(set(p.name for p in model_dir.glob("*.safetensors")) - set(shards)):
            if extra.startswith("consolidated"):       # Mistral ships its native-format weights beside the HF ones
                logger.info("ignoring %s: not listed in %s", model_dir / extra, INDEX)
                continue
            raise ValueError(f"{model_dir / extra} is not listed in {index}: a stray or foreign shard would mix "
                             "weights; remove it or list its tensors in the index")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        present = ", ".join(sorted(p.name for p in model_dir.iterdir())) or "nothing"
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (found: {present}); "
                                "only safetensors checkpoints are supported")
    return files


def open_weights(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"cannot read weights file {file}: {e} (truncated or not a safetensors file?)") from e


def read_tensor_names(files: list[Path], index: Path | None = None) -> dict[str, Path]:
    """tensor name -> file, from the safetensors headers only. A tensor in two files, or one the index places in
    a file that lacks it, is an error."""
    names: dict[str, Path] = {}
    for file in files:
        with open_weights(file) as f:
            for key in f.keys():
                if key in names:
                    raise ValueError(f"tensor {key} is in both {names[key]} and {file}")
                names[key] = file
    if index is not None and index.is_file():
        for key, shard in read_json_object(index)["weight_map"].items():
            if key in names and names[key].name != shard:
                raise ValueError(f"{index} places {key} in {shard}, but {names[key]} holds it")
            if key not in names:
                raise ValueError(f"{index} places {key} in {shard}, which does not hold it")
    return names


def check_layer_count(names: dict[str, Path], num_layers: int, config_file: Path) -> None:
    """The weights' decoder blocks are exactly 0 .. num_hidden_layers - 1."""
    layers: dict[int, str] = {}
    for key in names:
        m = _LAYER.match(key)
        if m:
            layers.setdefault(int(m[1]), key)
    beyond = sorted(i for i in layers if i >= num_layers)
    if beyond:
        key = layers[beyond[0]]
        raise ValueError(f"{config_file} says num_hidden_layers = {num_layers}, but {names[key]} holds {key} "
                         f"(the weights have {max(layers) + 1} layers)")
    absent = [i for i in range(num_layers) if i not in layers]
    if layers and absent:
        raise ValueError(f"{config_file} says num_hidden_layers = {num_layers}, but the weights have no tensors for "
                         f"layer {absent[0]} (they hold {len(layers)} layers)")


def check_float_tensor(key: str, file: Path, tensor: torch.Tensor) -> None:
    """A tensor that becomes a float parameter (norms, embeddings, dense weights, biases) must be floating point."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{key} in {file} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected a float "
                         "dtype (float16, bfloat16 or float32)")


def check_finite(key: str, file: Path, tensor: torch.Tensor) -> None:
    """No NaN or Inf in a float tensor. aminmax propagates NaN and reads the tensor once: 0.23 s per GB on one
    CPU core (isfinite().all() takes 3.0), so the whole check is cheap beside reading the weights."""
    if tensor.dtype not in FLOAT_DTYPES or tensor.numel() == 0:
        return
    lo, hi = torch.aminmax(tensor.reshape(-1))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{key} in {file} holds {bad} NaN or Inf values: the checkpoint is corrupt")
