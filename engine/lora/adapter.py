"""Reads a PEFT LoRA adapter as PEFT saves it (adapter_config.json + adapter_model.safetensors) and checks it
against the model it is to serve on, refusing at load, with a ValueError naming the adapter and the tensor,
whatever would not apply exactly: a module we cannot target, a shape that does not fit, a rank above the slots'.

Tensor names: base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight, A [r, K], B [N, r].
The delta of a module is scale * B @ A with scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
(rank_pattern / alpha_pattern: per module, keyed by a suffix of its name as PEFT matches them).
"""
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's module name -> (our module under the layer, part), for checkpoints with separate projections
SEPARATE = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
            "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
            "down_proj": ("mlp.down_proj", 0)}
# Phi-3: the checkpoint's own fused modules
FUSED = {"qkv_proj": ("self_attn.qkv_proj", 0), "o_proj": ("self_attn.o_proj", 0),
         "gate_up_proj": ("mlp.gate_up_proj", 0), "down_proj": ("mlp.down_proj", 0)}
TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int                      # the largest rank of its modules
    # "model.layers.3.self_attn.qkv_proj" -> {part: (A [r, K], B [N_part, r], scale)}
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = field(default_factory=dict)


def read_config(name: str, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {name!r}: {file} is not valid JSON ({e})") from None
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type} is not LORA")
    unsupported = {"use_dora": bool(config.get("use_dora")), "modules_to_save": bool(config.get("modules_to_save")),
                   "bias": config.get("bias", "none") != "none"}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported "
                             "(only plain LoRA on the decoder layers' linear modules)")
    if "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"LoRA adapter {name!r}: {file} has no 'r' or 'lora_alpha'")
    return config


def _pattern(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that module's name ends with (as a dotted suffix)."""
    for key, value in (patterns or {}).items():
        if re.search(rf"(^|\.){key}$", module):
            return value
    return default


def load_adapter(name: str, path: str | Path, max_rank: int, fused_checkpoint: bool,
                 shapes: dict[str, tuple[int, list[int]]], device: torch.device | str = "cpu") -> LoRAAdapter:
    """shapes: each LoRA-wrapped module of the model -> (in_features, output_sizes). -> the adapter's tensors on
    `device`, checked against them."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a directory")
    config = read_config(name, path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path} (adapter_model.bin is not read)")
    targets = FUSED if fused_checkpoint else SEPARATE
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), "pt", device="cpu") as f:
        for tensor_name in f.keys():
            m = TENSOR.match(tensor_name)
            if m is None:
                raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} is not a LoRA A/B of a decoder "
                                 f"layer's linear module (supported targets: {', '.join(targets)})")
            layer, parent, leaf, which = m.groups()
            if leaf not in targets or targets[leaf][0].split(".")[0] != parent:
                raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} targets {parent}.{leaf}, which this "
                                 f"model cannot take (supported targets: {', '.join(targets)})")
            module, part = targets[leaf]
            key = (f"model.layers.{layer}.{module}", part)
            if key[0] not in shapes:
                raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} is for layer {layer}, which the "
                                 "model does not have")
            t = f.get_tensor(tensor_name)
            if not t.is_floating_point():
                raise ValueError(f"LoRA adapter {name!r}: tensor {tensor_name} has dtype {t.dtype}, expected float")
            found.setdefault(key, {})[which] = (t, tensor_name)
    adapter = LoRAAdapter(name, path, 0)
    use_rslora = bool(config.get("use_rslora", False))
    for (module, part), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            only = next(iter(pair.values()))[1]
            raise ValueError(f"LoRA adapter {name!r}: tensor {only} has no lora_{'B' if 'A' in pair else 'A'} "
                             "partner")
        (a, a_name), (b, b_name) = pair["A"], pair["B"]
        k, sizes = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or a.shape[1] != k:
            raise ValueError(f"LoRA adapter {name!r}: tensor {a_name} has shape {tuple(a.shape)}, expected "
                             f"(r, {k})")
        if b.dim() != 2 or tuple(b.shape) != (sizes[part], r):
            raise ValueError(f"LoRA adapter {name!r}: tensor {b_name} has shape {tuple(b.shape)}, expected "
                             f"{(sizes[part], r)}")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: tensor {a_name} has rank {r}, above --max-lora-rank "
                             f"{max_rank}")
        peft_module = a_name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        alpha = float(_pattern(config.get("alpha_pattern"), peft_module, config["lora_alpha"]))
        declared = int(_pattern(config.get("rank_pattern"), peft_module, config["r"]))
        if declared != r:
            raise ValueError(f"LoRA adapter {name!r}: tensor {a_name} has rank {r}, but its config says {declared}")
        scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        adapter.modules.setdefault(module, {})[part] = (a.to(device), b.to(device), scale)
        adapter.rank = max(adapter.rank, r)
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {name!r}: {weights} holds no LoRA tensors")
    return adapter
