"""Integer KV cache (int8 / int4): the storage format and its torch twin (quantize-on-write, dequantize-on-read).

Storage per layer, beside each other and indexed by the same block ids (so block copies, swaps and the prefix
cache move a block's scales with its codes):
  codes  [num_blocks, block_size, Hkv, D]      int8  (int8 cache: symmetric codes -127..127)
         [num_blocks, block_size, Hkv, D // 2] uint8 (int4 cache: two 4-bit codes a byte, element 2i in the low
                                                     nibble, 2i + 1 in the high one)
  scales [num_blocks, block_size, Hkv, D // group, S] fp16, S = 1 (symmetric: scale) or 2 (scale, zero point)
The format is read off the tensors themselves (codes dtype: bits; scales shape: group and zero point), so every
call keeps the fp8 signatures: the scales tensor travels where the per-layer fp8 scale does (k_scale / v_scale).

Quantization is per token and kv head over groups of `group` head_dim elements, for K and for V alike: a decode
step writes one token, whose range is all that quantize-on-write knows (a per-channel K scale would need the
whole block first). Rounding is floor(x + 0.5) in fp32, as in the Triton store kernel (kv_int_kernels.py), so
both write the same codes. Measured accuracy of the choices: docs/performance.md, "Integer KV cache".
"""
import math
from dataclasses import dataclass

import torch

INT_KV_DTYPES = (torch.int8, torch.uint8)      # codes: int8 cache, packed int4 cache


@dataclass(frozen=True)
class IntKVFormat:
    bits: int            # 8 or 4
    group: int           # head_dim elements per scale; head_dim = one scale per token and head
    zero_point: bool     # asymmetric: a zero point (the group's minimum) stored beside each scale
    rotate: bool = False  # K and V stored rotated by hadamard(head_dim) (engine/worker/attention.py rotates)

    def validate(self, head_dim: int) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"integer KV cache: bits must be 4 or 8, not {self.bits}")
        if self.group <= 0 or head_dim % self.group or (self.bits == 4 and self.group % 2):
            raise ValueError(f"integer KV cache: group {self.group} must divide head_dim {head_dim}"
                             + (" and be even (two 4-bit codes a byte)" if self.bits == 4 else ""))
        if self.bits == 8 and self.zero_point:
            raise ValueError("integer KV cache: int8 is symmetric (no zero point)")
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(f"integer KV cache: the Hadamard rotation needs head_dim a power of two, not {head_dim}")

    def describe(self, head_dim: int, exact_tokens: int = 0) -> str:
        """As the start-up log and the eval report name it, e.g. "int4 (one scale per token and head, symmetric,
        Hadamard-rotated, last 24 tokens exact)"."""
        parts = ["one scale per token and head" if self.group == head_dim else f"groups of {self.group}",
                 "zero point" if self.zero_point else "symmetric"] + (["Hadamard-rotated"] if self.rotate else [])
        if exact_tokens:
            parts.append(f"last {exact_tokens} tokens exact")
        return f"int{self.bits} ({', '.join(parts)})"

    def code_shape(self, head_dim: int) -> int:
        """Last dimension of the codes tensor."""
        return head_dim if self.bits == 8 else head_dim // 2

    def scale_shape(self, head_dim: int) -> tuple[int, int]:
        return head_dim // self.group, 2 if self.zero_point else 1

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    def bytes_per_head_token(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one kv head: codes plus fp16 scales (and zero points)."""
        groups, s = self.scale_shape(head_dim)
        return self.code_shape(head_dim) + 2 * groups * s


def is_int_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in INT_KV_DTYPES


def format_of(codes: torch.Tensor, scales: torch.Tensor) -> IntKVFormat:
    """The format of a codes tensor [..., Dc] and its scales [..., G, S] (see the module doc)."""
    bits = 8 if codes.dtype == torch.int8 else 4
    head_dim = codes.shape[-1] * (8 // bits)
    return IntKVFormat(bits, head_dim // scales.shape[-2], scales.shape[-1] == 2)


def _qmax(fmt: IntKVFormat) -> float:
    return 127.0 if fmt.bits == 8 else (15.0 if fmt.zero_point else 7.0)


def quantize_int(x: torch.Tensor, fmt: IntKVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes [..., Dc], scales [..., D // group, S] fp16). The codes are computed against the
    fp16-rounded scale and zero point, i.e. against what is stored."""
    d = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], d // fmt.group, fmt.group)            # [..., G, group]
    qmax = _qmax(fmt)
    if fmt.zero_point:
        lo = xg.amin(-1, keepdim=True)
        zero = lo.half().float()
        scale = ((xg.amax(-1, keepdim=True) - zero) / qmax).half().float()
    else:
        zero = torch.zeros_like(xg[..., :1])
        scale = (xg.abs().amax(-1, keepdim=True) / qmax).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))               # an all-zero group: codes 0
    q = torch.floor((xg - zero) / scale + 0.5)
    q = q.clamp(0, qmax) if fmt.zero_point else q.clamp(-qmax - (fmt.bits == 4), qmax)
    q = q.reshape(*x.shape[:-1], d)
    scales = (torch.cat([scale, zero], -1) if fmt.zero_point else scale).half()
    if fmt.bits == 8:
        return q.to(torch.int8), scales
    u = (q + (0 if fmt.zero_point else 8)).to(torch.uint8)                       # nibbles 0..15
    return u[..., 0::2] | (u[..., 1::2] << 4), scales


def dequantize_int(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., Dc], scales [..., G, S] -> fp32 [..., D]."""
    fmt = format_of(codes, scales)
    if fmt.bits == 8:
        q = codes.float()
    else:
        q = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).float()         # [..., D]
        if not fmt.zero_point:
            q = q - 8
    d = q.shape[-1]
    s = scales.float()
    qg = q.reshape(*q.shape[:-1], d // fmt.group, fmt.group) * s[..., :1]
    if fmt.zero_point:
        qg = qg + s[..., 1:]
    return qg.reshape(*q.shape[:-1], d)


def store_int_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """x [N, Hkv, D] -> the flat slots [N] of codes / scales (already filtered: no -1)."""
    num_blocks, block_size = codes.shape[:2]
    q, s = quantize_int(x, format_of(codes, scales))
    codes.view(num_blocks * block_size, *codes.shape[2:])[slots] = q
    scales.view(num_blocks * block_size, *scales.shape[2:])[slots] = s


def alloc_int_cache(fmt: IntKVFormat, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (codes, scales) of one layer's K or V."""
    fmt.validate(head_dim)
    codes = torch.zeros((num_blocks, block_size, num_kv_heads, fmt.code_shape(head_dim)), dtype=fmt.code_dtype,
                        device=device)
    scales = torch.zeros((num_blocks, block_size, num_kv_heads, *fmt.scale_shape(head_dim)), dtype=torch.float16,
                         device=device)
    return codes, scales


# The grouping each --kv-cache-dtype gets (chosen by measured accuracy on the demo model and by what fits, see
# docs/performance.md): (group, zero point, rotate); a head_dim the group does not divide gets one group per head,
# one that is not a power of two no rotation. int4: one fp16 scale per token and head (4.13 bits an element at
# head_dim 128: Qwen2.5-7B holds over 1M tokens at 24 GiB) with a 24-token exact window (kv_exact.py), which
# buys more accuracy than groups of 16 with zero points (6 bits an element) did.
INT_KV_DEFAULTS = {"int8": (0, False, False), "int4": (0, False, True)}     # group 0: the whole head
INT_KV_EXACT_TOKENS = {"int8": 0, "int4": 24}
MAX_EXACT_TOKENS = 1024


def int_kv_exact_tokens(kv_cache_dtype: str, exact_tokens: int | None = None) -> int:
    """The exact window (tokens) of a --kv-cache-dtype: 0 for float caches, the default or the override."""
    if kv_cache_dtype not in INT_KV_EXACT_TOKENS:
        return 0
    n = INT_KV_EXACT_TOKENS[kv_cache_dtype] if exact_tokens is None else exact_tokens
    if not 0 <= n <= MAX_EXACT_TOKENS:
        raise ValueError(f"kv_exact_tokens must be between 0 and {MAX_EXACT_TOKENS}, not {n}")
    return n


def int_kv_format(kv_cache_dtype: str, head_dim: int, group: int | None = None, zero_point: bool | None = None,
                  rotate: bool | None = None) -> IntKVFormat | None:
    """The integer format of a --kv-cache-dtype (None: not an integer cache); group / zero_point / rotate
    override the defaults (the accuracy bench compares them)."""
    if kv_cache_dtype not in INT_KV_DEFAULTS:
        return None
    dg, dz, dr = INT_KV_DEFAULTS[kv_cache_dtype]
    if group is None:           # the default falls back to the whole head; an explicit group must divide it
        group = head_dim if dg == 0 or head_dim % dg else dg
    group = group or head_dim
    rotate = (dr and head_dim & (head_dim - 1) == 0) if rotate is None else rotate
    fmt = IntKVFormat(8 if kv_cache_dtype == "int8" else 4, group, dz if zero_point is None else zero_point, rotate)
    fmt.validate(head_dim)
    return fmt


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n] fp32 (n a power of two). Symmetric, so it is its own
    inverse: keys and queries rotated alike keep their dot products, and P (V H) H = P V."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard: n must be a power of two, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32).to(device)
