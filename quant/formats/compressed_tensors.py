"""compressed-tensors `pack-quantized` W4A16 (formats.md section 3): weight_packed int32 [N, K/8] packed along K,
weight_scale [N, G] (model dtype), weight_zero_point int32 [N/8, G] packed along N (asym only), weight_shape [2].
Nibbles hold signed value + 8. Dequant: sym W = (u - 8) * s; asym W = (u - uz) * s."""
import re
from dataclasses import dataclass, field

import torch

from quant_serve.kernels.matmul.reference import pack_int4_cols, pack_int4_rows, unpack_int4_cols, unpack_int4_rows
from quant_serve.quant.formats.base import (Int4Weights, QuantConfig, check_codes, check_dtype, check_features,
                                            check_groups, check_shape, get_tensor, num_groups, pack_zeros,
                                            perm_from_g_idx, trivial_g_idx)

FORMAT = "pack-quantized"


@dataclass
class WeightScheme:
    """One config group's `weights` args, reduced to what the reader needs."""
    symmetric: bool
    group_size: int                       # -1 for the channel strategy
    targets: list[str]


def _matches(name: str, target: str) -> bool:
    """compressed-tensors matching: 're:' regex (re.match) or exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass
class CompressedTensorsConfig(QuantConfig):
    schemes: list[WeightScheme] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    marker = "weight_packed"

    @classmethod
    def from_dict(cls, raw: dict, source: str, tensor_names) -> "CompressedTensorsConfig":
        top_format = raw.get("format")
        schemes = []
        for name, group in (raw.get("config_groups") or {}).items():
            where = f"{source}: compressed-tensors config_groups.{name}"
            fmt = group.get("format") or top_format
            if fmt != FORMAT:
                raise ValueError(f"{where} has format {fmt!r}; only {FORMAT!r} (W4A16) is supported")
            if group.get("input_activations") or group.get("output_activations"):
                raise ValueError(f"{where} quantizes activations; only weight-only W4A16 is supported")
            w = group.get("weights") or {}
            if w.get("type", "int") != "int" or int(w.get("num_bits", 0)) != 4:
                raise ValueError(f"{where}: weights {w.get('type')} {w.get('num_bits')}-bit are not supported "
                                 "(only int 4-bit)")
            strategy = w.get("strategy")
            if strategy == "group":
                group_size = int(w.get("group_size") or 0)
                if group_size <= 0:
                    raise ValueError(f"{where}: strategy 'group' needs a positive group_size")
            elif strategy == "channel":
                group_size = -1
            else:
                raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (group or channel)")
            if w.get("actorder") == "dynamic":
                raise ValueError(f"{where}: actorder 'dynamic' is not supported")
            schemes.append(WeightScheme(bool(w.get("symmetric", True)), group_size, list(group.get("targets", []))))
        if not schemes:
            raise ValueError(f"{source}: compressed-tensors config has no config_groups")
        if top_format not in (None, FORMAT, "mixed-precision"):    # the groups' formats say pack-quantized
            raise ValueError(f"{source}: compressed-tensors format {top_format!r} disagrees with its config_groups "
                             f"({FORMAT!r}); only {FORMAT!r} (W4A16) is supported")
        sizes = {s.group_size for s in schemes}
        return cls("compressed-tensors", 4, sizes.pop() if len(sizes) == 1 else schemes[0].group_size, source,
                   tensor_names, schemes=schemes, ignore=list(raw.get("ignore") or []))

    def describe(self) -> str:
        parts = []
        for s in self.schemes:
            group = "per-channel" if s.group_size == -1 else f"group {s.group_size}"
            parts.append(f"{group}, {'symmetric' if s.symmetric else 'zero point'}")
        return f"compressed-tensors {FORMAT}, 4-bit, " + "; ".join(dict.fromkeys(parts))

    def scheme(self, prefix: str) -> WeightScheme | None:
        """The config group covering this Linear: exact or regex name targets win over the class target."""
        by_name = [s for s in self.schemes if any(_matches(prefix, t) for t in s.targets)]
        by_class = [s for s in self.schemes if "Linear" in s.targets]
        found = by_name or by_class
        return found[0] if found else None

    def skip_reason(self, prefix: str) -> str | None:
        hits = [t for t in self.ignore if _matches(prefix, t)]
        if hits:
            return f"ignore entry {hits[0]!r}"
        if self.scheme(prefix) is None:
            return "no config group targets it"
        return None

    def expects_quantized(self, prefix: str) -> bool:
        return True                       # any Linear a group targets and `ignore` does not list

    def module_group_size(self, prefix: str) -> int:
        return self.scheme(prefix).group_size

    def required_suffixes(self, prefix: str) -> list[str]:
        names = ["weight_packed", "weight_scale"]
        return names if self.scheme(prefix).symmetric else names + ["weight_zero_point"]

    def convert(self, tensors, prefix, in_features, out_features, group_size) -> Int4Weights:
        k, n = in_features, out_features
        g = num_groups(k, group_size)
        check_features(k, n, prefix)
        packed = get_tensor(tensors, "weight_packed", prefix)
        scale = get_tensor(tensors, "weight_scale", prefix)
        if "weight_shape" in tensors:
            shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
            if shape != (n, k):
                raise ValueError(f"{prefix}.weight_shape is {list(shape)}, expected {[n, k]}")
        check_dtype(packed, (torch.int32,), f"{prefix}.weight_packed")
        check_shape(packed, (n, (k + 7) // 8), f"{prefix}.weight_packed", f" for [N, ceil(K/8)] (K={k}, N={n})")
        check_dtype(scale, (torch.float16, torch.bfloat16, torch.float32), f"{prefix}.weight_scale")
        if scale.dim() == 2 and scale.shape[0] == n:
            check_groups(scale.shape[1], g, group_size, f"{prefix}.weight_scale")
        check_shape(scale, (n, g), f"{prefix}.weight_scale", " for [N, K/G]")
        perm = perm_from_g_idx(tensors.get("weight_g_idx"), k, group_size, f"{prefix}.weight_g_idx")
        if perm is None:
            qweight = packed.t().contiguous()         # CT rows are GPTQ columns, bit for bit
        else:
            q = unpack_int4_cols(packed)[:, :k]       # [N, K]; trims the pad past weight_shape
            qweight = pack_int4_rows(q.t()[perm.to(q.device)])
        qzeros = None
        if not self.scheme(prefix).symmetric:
            zp = get_tensor(tensors, "weight_zero_point", prefix)
            check_dtype(zp, (torch.int32,), f"{prefix}.weight_zero_point")
            check_shape(zp, ((n + 7) // 8, g), f"{prefix}.weight_zero_point", " for [N/8, K/G]")
            qzeros = pack_zeros(unpack_int4_rows(zp)[:n].t())         # [G, N] real (unsigned) zeros
        return Int4Weights(qweight, scale.t().contiguous(), qzeros, perm, tensors.get("bias"))


# ---- writer ----------------------------------------------------------------------------------------------

def write_pack_quantized(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                         g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Codes q [N, K] (0..15 = signed + 8), scales [G, N], zeros [G, N] (None = symmetric) -> CT tensors.
    scale_dtype is the model dtype (llm-compressor writes scales in it; often bf16)."""
    n, k = q.shape
    check_codes(q, scales, zeros, group_size)
    if not trivial_g_idx(g_idx, k, group_size):
        raise ValueError("compressed-tensors cannot store act-order groups (weight_g_idx was removed in 0.20); "
                         "quantize with actorder='weight' or write GPTQ")
    out = {
        "weight_packed": pack_int4_cols(q.to(torch.int32)),           # [N, K/8]
        "weight_scale": scales.t().to(scale_dtype).contiguous(),      # [N, G]
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if zeros is not None:
        out["weight_zero_point"] = pack_int4_cols(zeros.to(torch.int32)).t().contiguous()   # [N/8, G]
    if bias is not None:
        out["bias"] = bias.to(scale_dtype).contiguous()
    return out


def ct_quantization_config(group_size: int = 128, sym: bool = True, ignore: list[str] | None = None) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group" if group_size > 0 else "channel",
               "group_size": group_size if group_size > 0 else None, "dynamic": False, "actorder": None,
               "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": FORMAT}},
            "ignore": ["lm_head"] if ignore is None else list(ignore), "kv_cache_scheme": None}
