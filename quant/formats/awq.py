"""AutoAWQ `version: gemm` (formats.md section 1): qweight [K, N/8] and qzeros [G, N/8] packed along N with the
[0,2,4,6,1,3,5,7] interleave, fp16 scales [G, N], real zeros. Dequant: W[n,k] = (q[k,n] - z[k//G,n]) * s[k//G,n]."""
from dataclasses import dataclass, field

import torch

from quant_serve.kernels.matmul.reference import pack_int4_cols, pack_int4_rows, unpack_int4_cols
from quant_serve.quant.formats.base import (Int4Weights, QuantConfig, check_codes, check_dtype, check_features,
                                            check_groups, check_shape, get_tensor, num_groups, pack_zeros,
                                            trivial_g_idx)

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]          # nibble i of a word holds column 8j + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8j + c sits in nibble AWQ_REVERSE_ORDER[c]
SUPPORTED_VERSIONS = ("gemm",)
OTHER_VERSIONS = ("gemv", "gemv_fast", "marlin", "llm-awq", "exllama", "ipex")


def _column_index(n: int, order: list[int]) -> torch.Tensor:
    return (torch.arange(n).view(-1, 8)[:, order]).reshape(-1)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] AWQ-interleaved int32 -> [R, N] codes in column order."""
    nibbles = unpack_int4_cols(packed)                           # [R, N], nibble order
    return nibbles[:, _column_index(nibbles.shape[1], AWQ_REVERSE_ORDER).to(packed.device)]


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, N] codes 0..15 -> [R, N/8] int32 with the AWQ interleave."""
    return pack_int4_cols(codes[:, _column_index(codes.shape[1], AWQ_ORDER).to(codes.device)])


@dataclass
class AWQConfig(QuantConfig):
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict, source: str, tensor_names) -> "AWQConfig":
        bits = int(raw.get("bits", raw.get("w_bit", 4)))
        group_size = int(raw.get("group_size", raw.get("q_group_size", 128)))
        version = str(raw.get("version") or raw.get("format") or "gemm").lower()
        zero_point = bool(raw.get("zero_point", True))
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"{source}: AWQ version {version!r} is not supported; quant-serve reads only 'gemm' "
                             f"(gemv/gemv_fast/marlin/llm-awq use different tensor layouts); re-export the model "
                             "with version='gemm'")
        if bits != 4:
            raise ValueError(f"{source}: AWQ with {bits} bits is not supported (only 4)")
        if not zero_point:
            raise ValueError(f"{source}: AWQ zero_point=false is not supported (AutoAWQ cannot pack it either)")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"{source}: invalid AWQ group_size {group_size}")
        if tensor_names is not None:
            scaled = sorted(n for n in tensor_names if n.endswith(".act.scales"))
            if scaled:
                raise ValueError(f"{source}: AWQ scaled activations ({scaled[0]}) are not supported")
        skip = list(raw.get("modules_to_not_convert") or [])
        return cls("awq", bits, group_size, source, tensor_names, zero_point, version, skip)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"awq {self.version}, {self.bits}-bit, {group}, zero point"

    def skip_reason(self, prefix: str) -> str | None:
        hits = [m for m in self.modules_to_not_convert if m in prefix]   # substring match, as AutoAWQ does
        return f"modules_to_not_convert {hits[0]!r}" if hits else None

    def required_suffixes(self, prefix: str) -> list[str]:
        return ["qweight", "qzeros", "scales"]

    def convert(self, tensors, prefix, in_features, out_features, group_size) -> Int4Weights:
        k, n = in_features, out_features
        g = num_groups(k, group_size)
        qweight = get_tensor(tensors, "qweight", prefix)
        qzeros = get_tensor(tensors, "qzeros", prefix)
        scales = get_tensor(tensors, "scales", prefix)
        check_features(k, n, prefix)
        hint = _layout_hint(qweight, scales, k, n)
        check_dtype(qweight, (torch.int32,), f"{prefix}.qweight", hint)
        check_shape(qweight, (k, n // 8), f"{prefix}.qweight", f" for AWQ gemm [K, N/8] (K={k}, N={n}){hint}")
        check_dtype(qzeros, (torch.int32,), f"{prefix}.qzeros", hint)
        check_dtype(scales, (torch.float16, torch.bfloat16, torch.float32), f"{prefix}.scales")
        if scales.dim() == 2 and scales.shape[1] == n:
            check_groups(scales.shape[0], g, group_size, f"{prefix}.scales")
        check_shape(scales, (g, n), f"{prefix}.scales", f" for AWQ gemm [K/G, N]{hint}")
        check_shape(qzeros, (g, n // 8), f"{prefix}.qzeros", f" for AWQ gemm [K/G, N/8]{hint}")
        q = unpack_awq(qweight)                                       # [K, N]
        z = unpack_awq(qzeros)                                        # [G, N]
        return Int4Weights(pack_int4_rows(q), scales, pack_zeros(z), None, tensors.get("bias"))


def _layout_hint(qweight: torch.Tensor, scales: torch.Tensor, k: int, n: int) -> str:
    """Name the AWQ layout a mismatching tensor set most likely comes from."""
    if qweight.dtype == torch.int16:
        return " (int16 qweight: this is the AWQ 'gemv_fast' layout, which quant-serve does not read)"
    if tuple(qweight.shape) == (n, k // 8) and scales.dim() == 2 and scales.shape[0] == n:
        return (" (qweight [N, K/8] with scales [N, ...]: this is the AWQ 'gemv' layout, which quant-serve "
                "does not read)")
    return ""


# ---- writer ----------------------------------------------------------------------------------------------

def write_awq_gemm(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                   g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Codes q [N, K] (0..15), scales [G, N], zeros [G, N] (None = symmetric, stored as z = 8) -> AutoAWQ tensors."""
    n, k = q.shape
    check_codes(q, scales, zeros, group_size)
    if not trivial_g_idx(g_idx, k, group_size):
        raise ValueError("AWQ cannot store act-order groups (a non-trivial g_idx); write GPTQ instead")
    if zeros is None:
        zeros = torch.full(tuple(scales.shape), 8, dtype=torch.int32)
    out = {
        "qweight": pack_awq(q.t().to(torch.int32)),                   # [K, N/8]
        "qzeros": pack_awq(zeros.to(torch.int32)),                    # [G, N/8]
        "scales": scales.to(torch.float16).contiguous(),              # [G, N]
    }
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


def awq_quantization_config(group_size: int = 128, modules_to_not_convert: list[str] | None = None) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": modules_to_not_convert}
