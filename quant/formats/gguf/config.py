"""GGUF checkpoints as a QuantConfig: each linear layer's implementation follows its tensors' GGUF types (a Q4_K_M
file mixes Q4_K and Q6_K): all INT4 types -> QuantLinear with float offsets, all float -> DenseLinear, anything
else -> W8Linear (8-bit codes; an INT4 shard merged with an 8-bit one is widened losslessly, and groups of 32 are
split into the finer group of the other shard). Q4_K, Q5_K and Q6_K keep their own bits: a layer of one of them in
its native layout, a merged layer mixing them (Q4_K_M / Q5_K_M's qkv) in parts (quant/layers/parts.py)."""
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from gguf import GGMLQuantizationType as T

from quant_serve.quant.formats.base import Int4Weights, QuantConfig
from quant_serve.quant.formats.gguf.types import (GroupedCodes, group_size_of, int4_layout, kquant_layout, path_of,
                                                  q5k_layout, q6k_layout, w8_layout)
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.layers.parts import PartsLinear
from quant_serve.quant.layers.w8 import W8Linear, W8Weights

_LAYER = re.compile(r"\.layers\.(\d+)\.")
OFFSET_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K)      # loaded with per-group float offsets
NATIVE_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)   # kept in the file's own scales; a merged layer mixing them loads in parts
PATH_NAMES = {"int4": "INT4 (W4A16, float offsets)", "int4k": "INT4 Q4_K (W4A16, two-level scales, 4.625 bits)",
              "q5k": "Q5_K (5-bit: W4A16 fragment layout, 6 bits, on CUDA fp16; else W8A16 kernels, planes, "
                     "5.625 bits)",
              "q6k": "Q6_K (6-bit: W4A16 fragment layout, 7 bits, on CUDA fp16; else W8A16 kernels, planes, 6.5625 "
                     "bits)",
              "w8": "8-bit (W8A16)",
              "parts": "merged Q4_K / Q5_K + Q6_K (each run of shards in its own layout, outputs concatenated)",
              "dense": "float (dense)"}


@dataclass
class GGUFConfig(QuantConfig):
    """type_of: HF module prefix (model.layers.3.self_attn.v_proj, lm_head) -> the GGUF type of its weight."""
    type_of: Callable[[str], T] = field(default=None, repr=False)
    type_mix: dict[str, int] = field(default_factory=dict)    # GGUF type name -> tensors (the report's "mix")
    layer_paths: Counter = field(default_factory=Counter)     # path -> linear layers built on it (start-up log)

    marker: ClassVar[str] = "weight"
    float_offsets: ClassVar[bool] = True                      # QuantLinear.init_dummy: GGUF INT4 has offsets

    def describe(self) -> str:
        mix = ", ".join(f"{name} x {count}" for name, count in sorted(self.type_mix.items(), key=lambda kv: -kv[1]))
        paths = ", ".join(f"{count} {path.upper()}" for path, count in sorted(self.layer_paths.items()))
        return f"gguf ({mix}; linear layers: {paths})" if mix else "gguf"

    def describe_paths(self) -> str:
        return ", ".join(f"{count} {PATH_NAMES[path]}" for path, count in sorted(self.layer_paths.items()))

    def make_linear(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype, device,
                    source_prefixes: list[str]):
        types = [self.type_of(p) for p in source_prefixes]
        paths = {path_of(t) for t in types}
        if len(set(types)) > 1 and set(types) <= set(NATIVE_TYPES):
            self.layer_paths["parts"] += 1
            return self._parts_linear(in_features, output_sizes, bias, dtype, device, source_prefixes, types)
        if "dense" in paths:            # a float shard beside quantized ones: the quantized ones are dequantized
            path, layer = "dense", DenseLinear(in_features, output_sizes, bias, dtype, device)
        elif paths == {"int4"}:
            # Q4_K shards only: the kernels read the file's two-level scales (on CUDA; the CPU twin their products)
            path = "int4k" if set(types) == {T.Q4_K} else "int4"
            layer = QuantLinear(in_features, output_sizes, bias, dtype, device, self, 32, list(source_prefixes))
            layer.dummy_two_level = path == "int4k"
        else:
            path = "w8"
            group = min(group_size_of(t) for t in types)
            layer = W8Linear(in_features, output_sizes, bias, dtype, device, self, group, list(source_prefixes))
            layer.dummy_offsets = any(t in OFFSET_TYPES for t in types)
            if set(types) == {T.Q6_K}:           # Q6_K shards only: the 6-bit planes (kernels/matmul/planes/q6k.py)
                path, layer.q6k_planes = "q6k", True
            elif set(types) == {T.Q5_K}:         # Q5_K shards only: the 5-bit planes (kernels/matmul/planes/q5k.py)
                path, layer.q5k_planes = "q5k", True
        self.layer_paths[path] += 1
        return layer

    def convert(self, tensors, prefix, in_features, out_features, group_size) -> Int4Weights:
        g = _codes(tensors, prefix, in_features, out_features)
        if g.group_size != group_size:
            raise ValueError(f"{prefix}: GGUF groups of {g.group_size}, the layer expects {group_size}")
        if g.superscales is not None:
            qweight, sub_codes, superscales = kquant_layout(g)
            return Int4Weights(qweight, sub_codes, None, None, tensors.get("bias"), None, superscales)
        qweight, scales, offsets = int4_layout(g)
        return Int4Weights(qweight, scales, None, None, tensors.get("bias"), offsets)

    def _parts_linear(self, in_features, output_sizes, bias, dtype, device, prefixes, types) -> PartsLinear:
        """Runs of consecutive shards of one type, each its own native linear (no layer_paths count)."""
        parts, start = [], 0
        for i in range(1, len(types) + 1):
            if i == len(types) or types[i] != types[start]:
                shards = list(range(start, i))
                sizes, names = [output_sizes[s] for s in shards], [prefixes[s] for s in shards]
                if types[start] == T.Q4_K:
                    linear = QuantLinear(in_features, sizes, bias, dtype, device, self, 32, names)
                    linear.dummy_two_level = True
                elif types[start] == T.Q5_K:
                    linear = W8Linear(in_features, sizes, bias, dtype, device, self, 32, names)
                    linear.q5k_planes = True
                else:
                    linear = W8Linear(in_features, sizes, bias, dtype, device, self, 16, names)
                    linear.q6k_planes = True
                parts.append((linear, shards))
                start = i
        return PartsLinear(in_features, output_sizes, bias, parts, prefixes)

    def convert_q6k(self, tensors, prefix, in_features, out_features) -> W8Weights:
        g = _codes(tensors, prefix, in_features, out_features)
        return W8Weights(None, None, None, tensors.get("bias"), q6k_layout(g))

    def convert_q5k(self, tensors, prefix, in_features, out_features) -> W8Weights:
        g = _codes(tensors, prefix, in_features, out_features)
        return W8Weights(None, None, None, tensors.get("bias"), q5k=q5k_layout(g))

    def convert_w8(self, tensors, prefix, in_features, out_features, group_size) -> W8Weights:
        g = _codes(tensors, prefix, in_features, out_features)
        if g.group_size % group_size:
            raise ValueError(f"{prefix}: GGUF groups of {g.group_size} cannot be split into groups of {group_size}")
        repeat = g.group_size // group_size            # one group of 32 = two of 16 with the same scale and offset
        g = GroupedCodes(g.codes, g.scales.repeat_interleave(repeat, dim=1),
                         None if g.offsets is None else g.offsets.repeat_interleave(repeat, dim=1), group_size)
        qweight, scales, offsets = w8_layout(g)
        return W8Weights(qweight, scales, offsets, tensors.get("bias"))


def _codes(tensors: dict, prefix: str, k: int, n: int) -> GroupedCodes:
    g = tensors.get("codes")
    if not isinstance(g, GroupedCodes):
        raise ValueError(f"{prefix}: expected GGUF grouped codes, found {', '.join(sorted(tensors)) or 'nothing'}")
    if tuple(g.codes.shape) != (n, k):
        raise ValueError(f"{prefix}.weight has shape {tuple(g.codes.shape)}, expected {(n, k)}")
    return g


# ---- llama.cpp's type choice per file type, for --load-format dummy --quantization gguf:Q4_K_M -----------------

def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between get Q6_K."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def q4_k_m_type(prefix: str, num_layers: int, base: T = T.Q4_K) -> T:
    """The type llama.cpp's Q4_K_M (base Q4_K) or Q5_K_M (base Q5_K) gives a weight: Q6_K for the head and for
    half of the attn_v / ffn_down layers, the base type elsewhere."""
    if prefix == "lm_head":
        return T.Q6_K
    m = _LAYER.search(prefix)
    if m and prefix.endswith(("v_proj", "down_proj")) and _more_bits(int(m[1]), num_layers):
        return T.Q6_K
    return base


def plain_type(prefix: str, base: T) -> T:
    """The type llama.cpp's Q4_0 / Q8_0 files give a weight: the base type, the head Q6_K unless the base is
    Q8_0 (llama.cpp keeps an output tensor of Q8_0 files in Q8_0)."""
    return T.Q6_K if prefix == "lm_head" and base != T.Q8_0 else base


DUMMY_MIXES = {"Q4_K_M": q4_k_m_type,
               "Q5_K_M": lambda prefix, num_layers: q4_k_m_type(prefix, num_layers, T.Q5_K),
               "Q4_0": lambda prefix, num_layers: plain_type(prefix, T.Q4_0),
               "Q8_0": lambda prefix, num_layers: plain_type(prefix, T.Q8_0)}


def dummy_gguf_config(mix: str, num_layers: int) -> GGUFConfig:
    """A GGUFConfig for random weights with a real file's type mix (`--quantization gguf:Q4_K_M`)."""
    if mix.upper() not in DUMMY_MIXES:
        raise ValueError(f"--quantization gguf:{mix}: unknown GGUF type mix (supported: "
                         f"{', '.join('gguf:' + m for m in DUMMY_MIXES)})")
    rule = DUMMY_MIXES[mix.upper()]
    return GGUFConfig("gguf", 4, 32, f"--quantization gguf:{mix}", None,
                      type_of=lambda prefix: rule(prefix, num_layers), type_mix={mix.upper(): 1})
