"""GPTQ (AutoGPTQ / GPTQModel / optimum, formats.md section 2): qweight [K/8, N] packed along K (original K order),
qzeros [G, N/8] packed along N, fp16 scales [G, N], g_idx [K].
Dequant: W[n,k] = (q[k,n] - z[g_idx[k],n]) * s[g_idx[k],n], with z = stored nibble + 1 in v1
(`checkpoint_format: gptq`) and z = stored nibble in v2 (`gptq_v2`)."""
import re
from dataclasses import dataclass, field

import torch

from quant_serve.kernels.matmul.reference import pack_int4_cols, pack_int4_rows, unpack_int4_cols, unpack_int4_rows
from quant_serve.quant.formats.base import (_IN_BLOCK, Int4Weights, QuantConfig, check_codes, check_dtype,
                                            check_features, check_groups, check_shape, get_tensor, num_groups,
                                            pack_zeros, perm_from_g_idx)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass
class GPTQConfig(QuantConfig):
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    lm_head: bool = False
    dynamic: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict, source: str, tensor_names) -> "GPTQConfig":
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if raw.get("is_marlin_format") or fmt == "marlin":
            raise ValueError(f"{source}: GPTQ checkpoint_format 'marlin' (pre-permuted B/s tensors) is not "
                             "supported; use the plain gptq export")
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported "
                             f"(supported: {', '.join(CHECKPOINT_FORMATS)})")
        bits = int(raw.get("bits", 4))
        if bits != 4:
            raise ValueError(f"{source}: GPTQ with {bits} bits is not supported (only 4)")
        group_size = int(raw.get("group_size", 128))
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{source}: invalid GPTQ group_size {group_size}")
        dynamic = dict(raw.get("dynamic") or {})
        for rule, override in dynamic.items():
            if not rule.startswith("-:") and int((override or {}).get("bits", 4)) != 4:
                raise ValueError(f"{source}: GPTQ dynamic rule {rule!r} asks for {override['bits']} bits "
                                 "(only 4 is supported)")
        return cls("gptq", bits, group_size, source, tensor_names, sym=bool(raw.get("sym", True)),
                   desc_act=bool(raw.get("desc_act", False)), checkpoint_format=fmt,
                   lm_head=bool(raw.get("lm_head", False)), dynamic=dynamic)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        version = "v2" if self.checkpoint_format == "gptq_v2" else "v1"
        text = f"gptq {version}, {self.bits}-bit, {group}, {'symmetric' if self.sym else 'zero point'}"
        return text + (", act-order" if self.desc_act else "")

    def _rule(self, prefix: str) -> tuple[str, dict] | None:
        """The first GPTQModel `dynamic` rule whose regex matches (re.match, in order, as GPTQModel does):
        '-:' skips the module, '+:' or no prefix overrides bits/group_size/sym/desc_act."""
        for rule, override in self.dynamic.items():
            if re.match(rule[2:] if rule[:2] in ("-:", "+:") else rule, prefix):
                return rule, override or {}
        return None

    def _override(self, prefix: str) -> dict:
        rule = self._rule(prefix)
        return rule[1] if rule and not rule[0].startswith("-:") else {}

    def skip_reason(self, prefix: str) -> str | None:
        rule = self._rule(prefix)
        return f"dynamic rule {rule[0]!r}" if rule and rule[0].startswith("-:") else None

    def expects_quantized(self, prefix: str) -> bool:
        return _IN_BLOCK.search(prefix) is not None or (self.lm_head and prefix.endswith("lm_head"))

    def module_group_size(self, prefix: str) -> int:
        return int(self._override(prefix).get("group_size", self.group_size))

    def _sym(self, prefix: str) -> bool:
        return bool(self._override(prefix).get("sym", self.sym))

    def required_suffixes(self, prefix: str) -> list[str]:
        return ["qweight", "scales"] if self._sym(prefix) else ["qweight", "qzeros", "scales"]

    def convert(self, tensors, prefix, in_features, out_features, group_size) -> Int4Weights:
        k, n = in_features, out_features
        g = num_groups(k, group_size)
        check_features(k, n, prefix)
        qweight = get_tensor(tensors, "qweight", prefix)
        scales = get_tensor(tensors, "scales", prefix)
        check_dtype(qweight, (torch.int32,), f"{prefix}.qweight")
        check_shape(qweight, (k // 8, n), f"{prefix}.qweight", f" for GPTQ [K/8, N] (K={k}, N={n})")
        check_dtype(scales, (torch.float16, torch.bfloat16, torch.float32), f"{prefix}.scales")
        if scales.dim() == 2 and scales.shape[1] == n:
            check_groups(scales.shape[0], g, group_size, f"{prefix}.scales")
        check_shape(scales, (g, n), f"{prefix}.scales", " for GPTQ [K/G, N]")
        qzeros = None
        if "qzeros" in tensors:
            raw = tensors["qzeros"]
            check_dtype(raw, (torch.int32,), f"{prefix}.qzeros")
            check_shape(raw, (g, n // 8), f"{prefix}.qzeros", " for GPTQ [K/G, N/8]")
            qzeros = pack_zeros(self._real_zeros(raw, f"{prefix}.qzeros"))
        elif not self._sym(prefix):
            get_tensor(tensors, "qzeros", prefix)                      # raises, naming the tensor
        if self.desc_act and "g_idx" not in tensors:
            get_tensor(tensors, "g_idx", prefix)                        # act-order without its map: raise
        perm = perm_from_g_idx(tensors.get("g_idx"), k, group_size, f"{prefix}.g_idx")
        if perm is not None:
            qweight = pack_int4_rows(unpack_int4_rows(qweight)[perm.to(qweight.device)])
        return Int4Weights(qweight, scales, qzeros, perm, tensors.get("bias"))

    def _real_zeros(self, qzeros: torch.Tensor, name: str) -> torch.Tensor:
        """Stored qzeros [G, N/8] -> real zeros [G, N]."""
        stored = unpack_int4_cols(qzeros)
        if self.checkpoint_format == "gptq_v2":
            return stored
        bad = (stored == 15).nonzero()
        if len(bad):
            g, c = (int(v) for v in bad[0])
            word = int(qzeros[g, c // 8]) & 0xFFFFFFFF
            raise ValueError(
                f"{name}[{g}, {c // 8}] = 0x{word:08X} holds a 0xF nibble, i.e. zero point 16 under the v1 "
                "'stored + 1' rule: the checkpoint was packed from a group whose zero point was 0, which GPTQ v1 "
                "cannot store (AutoGPTQ wipes the higher nibbles, GPTQModel borrows from the next one), so these "
                "zeros cannot be decoded reliably. Re-export as gptq_v2, AWQ or compressed-tensors.")
        return stored + 1


# ---- writer ----------------------------------------------------------------------------------------------

def write_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
               g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Codes q [N, K] (0..15, original K order), scales [G, N], zeros [G, N] or None (sym, z = 8), g_idx [K] or
    None (k // G) -> GPTQ tensors. v1 (`gptq`) stores z - 1 and so is written for symmetric layers only."""
    n, k = q.shape
    g = check_codes(q, scales, zeros, group_size)
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r} (use gptq or gptq_v2)")
    if zeros is None:
        zeros = torch.full((g, n), 8, dtype=torch.int32)
    if checkpoint_format == "gptq":
        if not bool((zeros == 8).all()):
            raise ValueError("GPTQ v1 (checkpoint_format 'gptq') cannot store asymmetric zeros safely (z = 0 "
                             "wraps to -1 and corrupts the word); write checkpoint_format='gptq_v2', AWQ or "
                             "compressed-tensors")
        stored = zeros - 1                                             # 7 everywhere -> 0x77777777
    else:
        stored = zeros
    gs = k if group_size <= 0 else group_size
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    check_shape(g_idx, (k,), "g_idx")
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= g:
        raise ValueError(f"g_idx values must be in 0..{g - 1}")
    out = {
        "qweight": pack_int4_rows(q.t().to(torch.int32)),             # [K/8, N]
        "qzeros": pack_int4_cols(stored.to(torch.int32)),             # [G, N/8]
        "scales": scales.to(torch.float16).contiguous(),              # [G, N]
        "g_idx": g_idx.to(torch.int32).contiguous(),                  # [K]
    }
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


def gptq_quantization_config(group_size: int = 128, sym: bool = True, desc_act: bool = False,
                             checkpoint_format: str = "gptq") -> dict:
    if checkpoint_format == "gptq" and not sym:
        raise ValueError("GPTQ v1 cannot store asymmetric zeros safely; use checkpoint_format='gptq_v2'")
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
            "checkpoint_format": checkpoint_format, "format": checkpoint_format, "pack_dtype": "int32",
            "lm_head": False}
