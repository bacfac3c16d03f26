"""What every INT4 format shares: the QuantConfig base (per-module decisions) and the internal-layout record.

Internal layout (kernels/matmul/reference.py): qweight int32 [K/8, N] packed along K; scales [G, N]; qzeros int32
[G, N/8] packed along N holding REAL zeros, or None when every zero is 8 (symmetric); perm int64 [K] or None (act-order).
"""
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from quant_serve.kernels.matmul.reference import pack_int4_cols
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear

# A Linear inside a numbered block (model.layers.3.mlp.up_proj): AutoAWQ and GPTQ quantize only these.
_IN_BLOCK = re.compile(r"\.\d+\.")


@dataclass
class Int4Weights:
    """One source module in the internal layout."""
    qweight: torch.Tensor                 # int32 [K/8, N]
    scales: torch.Tensor                  # [G, N]
    qzeros: torch.Tensor | None           # int32 [G, N/8], real zeros; None = all 8
    perm: torch.Tensor | None = None      # int64 [K]; internal row r = original input channel perm[r]
    bias: torch.Tensor | None = None      # [N]
    offsets: torch.Tensor | None = None   # [G, N] float per-group offsets (GGUF), only with qzeros None
    superscales: torch.Tensor | None = None   # int32 [G/8, N]: GGUF Q4_K kept two-level (kernels/matmul/frag/kquant.py);
                                              # scales are then its int16 sub-codes [G, N], offsets None


@dataclass
class QuantConfig:
    """Base of the per-format configs. Subclasses set `marker` and implement the hooks below."""
    method: str
    bits: int
    group_size: int                       # -1 = one group over K
    source: str = "config.json"           # where quantization_config was found, for error messages
    tensor_names: frozenset[str] | None = field(default=None, repr=False)   # safetensors keys; None = dummy load

    marker: ClassVar[str] = "qweight"     # the tensor whose presence means "this module is quantized"

    # ---- hooks -------------------------------------------------------------------------------------------
    def describe(self) -> str:
        raise NotImplementedError

    def skip_reason(self, prefix: str) -> str | None:
        """A config rule that leaves this module unquantized (ignore list, modules_to_not_convert, dynamic -:)."""
        return None

    def expects_quantized(self, prefix: str) -> bool:
        """Whether the config alone says the module is quantized (then missing tensors are an error)."""
        return _IN_BLOCK.search(prefix) is not None

    def module_group_size(self, prefix: str) -> int:
        return self.group_size

    def required_suffixes(self, prefix: str) -> list[str]:
        return [self.marker]

    def convert(self, tensors: dict[str, torch.Tensor], prefix: str, in_features: int, out_features: int,
                group_size: int) -> Int4Weights:
        """One source module's raw checkpoint tensors -> the internal layout. group_size is already > 0."""
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------------------
    def make_linear(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                    device, source_prefixes: list[str]) -> nn.Module:
        prefixes = list(source_prefixes)
        if len(prefixes) != len(output_sizes):
            raise ValueError(f"{self.method}: make_linear needs one source prefix per output shard, got "
                             f"{prefixes} for output_sizes {list(output_sizes)}")
        kinds = {p: self._module_kind(p) for p in prefixes}
        if len(set(kinds.values())) > 1:
            detail = ", ".join(f"{p}: {k}" for p, k in kinds.items())
            raise ValueError(f"merged layer mixes quantized and unquantized source modules ({detail}); "
                             "they must agree")
        if kinds[prefixes[0]] == "dense":
            return DenseLinear(in_features, output_sizes, bias, dtype, device)
        group_sizes = {p: self.module_group_size(p) for p in prefixes}
        if len(set(group_sizes.values())) > 1:
            raise ValueError(f"merged layer has different group sizes per source module: {group_sizes}")
        return QuantLinear(in_features, output_sizes, bias, dtype, device, self,
                           group_sizes[prefixes[0]], prefixes)

    def _module_kind(self, prefix: str) -> str:
        """'quantized' or 'dense', from the config rules checked against the safetensors header."""
        names = self.tensor_names
        reason = self.skip_reason(prefix)
        has_marker = names is not None and f"{prefix}.{self.marker}" in names
        if reason is not None:
            if has_marker:
                raise ValueError(f"{prefix}.{self.marker} is in the checkpoint, but {self.source} leaves {prefix} "
                                 f"unquantized ({reason})")
            return "dense"
        if names is None:                      # dummy weights: the config is all there is
            return "quantized" if self.expects_quantized(prefix) else "dense"
        if has_marker:
            for suffix in self.required_suffixes(prefix):
                if f"{prefix}.{suffix}" not in names:
                    raise ValueError(f"{prefix}.{suffix} is missing from the checkpoint: {prefix}.{self.marker} "
                                     f"is there, and a {self.describe()} module needs "
                                     f"{', '.join(self.required_suffixes(prefix))}")
            return "quantized"
        if f"{prefix}.weight" in names:        # left in fp16 by the quantizer: trust the header, like vLLM
            return "dense"
        if self.expects_quantized(prefix):
            raise ValueError(f"{prefix}.{self.marker} is missing from the checkpoint: {self.source} "
                             f"({self.describe()}) quantizes {prefix}, and there is no {prefix}.weight either")
        return "dense"


# ---- helpers the readers share ---------------------------------------------------------------------------

def num_groups(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / group_size)


def get_tensor(tensors: dict[str, torch.Tensor], suffix: str, prefix: str) -> torch.Tensor:
    if suffix not in tensors:
        found = ", ".join(sorted(tensors)) or "nothing"
        raise ValueError(f"{prefix}.{suffix} is missing (found {found} for {prefix})")
    return tensors[suffix]


def check_dtype(t: torch.Tensor, dtypes: tuple, name: str, hint: str = "") -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}, expected {want}{hint}")


def check_shape(t: torch.Tensor, expected: tuple, name: str, hint: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)}{hint}")


def check_groups(actual: int, expected: int, group_size: int, name: str) -> None:
    if actual != expected:
        raise ValueError(f"{name} has {actual} groups, expected {expected} for group_size {group_size}")


def check_features(in_features: int, out_features: int, prefix: str) -> None:
    if in_features % 8:
        raise ValueError(f"{prefix}: in_features {in_features} is not a multiple of 8 (INT4 packs 8 per word)")
    if out_features % 8:
        raise ValueError(f"{prefix}: out_features {out_features} is not a multiple of 8 (zeros pack 8 per word)")


def perm_from_g_idx(g_idx: torch.Tensor | None, in_features: int, group_size: int, name: str) -> torch.Tensor | None:
    """g_idx [K] -> perm [K] int64 with g_idx[perm] == arange(K) // G, or None when g_idx is already k // G."""
    expected = torch.arange(in_features, device="cpu") // group_size
    if g_idx is None:
        return None
    check_shape(g_idx, (in_features,), name)
    g = g_idx.to("cpu", torch.int64)
    if torch.equal(g, expected):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], expected):
        raise ValueError(f"{name} is not a valid act-order map for group_size {group_size}: every group must hold "
                         f"{group_size} input channels (the last may hold fewer)")
    return perm


def pack_zeros(z: torch.Tensor) -> torch.Tensor | None:
    """Real zeros [G, N] -> internal qzeros [G, N/8], or None when all are 8 (the symmetric fast path)."""
    if bool((z == 8).all()):
        return None
    return pack_int4_cols(z)


def check_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> int:
    """Writer input checks: q [N, K] in 0..15, scales [G, N], zeros [G, N] in 0..15. Returns G."""
    if q.dim() != 2:
        raise ValueError(f"codes must be [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError(f"codes must be in 0..15, got {int(q.min())}..{int(q.max())}")
    gs = k if group_size <= 0 else group_size
    g = num_groups(k, gs)
    check_shape(scales, (g, n), "scales", f" for K={k}, group_size {group_size}")
    if zeros is not None:
        check_shape(zeros, (g, n), "zeros")
        if int(zeros.min()) < 0 or int(zeros.max()) > 15:
            raise ValueError(f"zeros must be in 0..15, got {int(zeros.min())}..{int(zeros.max())}")
    if k % 8 or n % 8:
        raise ValueError(f"[N, K] = {[n, k]}: both must be multiples of 8 to pack")
    return g


def trivial_g_idx(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> bool:
    gs = in_features if group_size <= 0 else group_size
    return g_idx is None or torch.equal(g_idx.to("cpu", torch.int64), torch.arange(in_features) // gs)
