"""The row layout of INT4 weights (bf16 layers, and fp16 layers the fragment layout does not take): a byte repack
of the standard layout (reference.py) that the row-layout Triton kernels (rows_gemv.py, rows_gemm.py) read."""
from dataclasses import dataclass

import torch

from quant_serve.kernels.matmul.frag.kquant import check_kquant
from quant_serve.kernels.matmul.reference import pack_int4_rows, unpack_int4_rows

DEFAULT_PACK_K = 128


@dataclass
class W4A16Weights:
    """INT4 weights in the kernel layout. qweight: int32 [ceil(K/pack_k)*pack_k/8, N] whose bytes, seen as uint8
    [Kp/2, N], hold per pack_k chunk c and row r < pack_k/2 the codes of rows c*pack_k + r (low nibble) and
    c*pack_k + pack_k/2 + r (high nibble), columns in col_perm order (pad rows hold code 0 and meet zero
    activations); scales [G, N]; qzeros int32 [G, ceil(N/8)] or None; offsets [G, N] like scales or None (GGUF's
    float per-group offset, W = q * s + o; only with qzeros None)."""
    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    group_size: int            # resolved: K for a checkpoint's -1
    in_features: int           # K
    pack_k: int
    perm: torch.Tensor | None  # int64 [K]: y = x[:, perm] @ W
    offsets: torch.Tensor | None = None
    superscales: torch.Tensor | None = None   # int32 [G/8, N]: Q4_K's d | dmin (kquant.py); scales are then the
                                              # int16 sub-codes

    @property
    def offset_mode(self) -> int:
        """The row kernels' OFFSETS constexpr: 0 zero points, 1 float offsets, 2 k-quant two-level scales."""
        return 2 if self.superscales is not None else 1 if self.offsets is not None else 0

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def slice_groups(self) -> bool:
        """True when a pack_k chunk spans several groups, so scales change per nibble slice."""
        return self.scales.shape[0] > 1 and self.group_size % self.pack_k != 0


def col_perm(n: int, device=None) -> torch.Tensor:
    """Byte position p of a kernel-layout row holds column col_perm(n)[p]: within each group of 4 columns the order
    is (0, 2, 1, 3) (an involution), so one LOP3 on a 4-byte word yields the fp16 pair of columns (n, n+1) and,
    after a shift by 8, the pair (n+2, n+3). Identity when N % 4 != 0 (those shapes take the plain path)."""
    p = torch.arange(n, device=device)
    return p if n % 4 else (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1)


def _to_bytes(codes: torch.Tensor, pack_k: int) -> torch.Tensor:
    """codes [Kp, N] natural order -> uint8 [Kp/2, N]: byte (c*pack_k/2 + r, p) = code[c*pack_k + r, col] |
    code[c*pack_k + pack_k/2 + r, col] << 4, col = col_perm(N)[p]."""
    kp, n = codes.shape
    c = codes.view(kp // pack_k, 2, pack_k // 2, n)
    b = (c[:, 0] | (c[:, 1] << 4)).reshape(kp // 2, n).to(torch.uint8)
    return b[:, col_perm(n, codes.device)]


def _from_bytes(b: torch.Tensor, pack_k: int) -> torch.Tensor:
    kp2, n = b.shape
    b = b[:, col_perm(n, b.device)].to(torch.int32).view(kp2 * 2 // pack_k, 1, pack_k // 2, n)
    return torch.cat([b & 0xF, b >> 4], dim=1).reshape(kp2 * 2, n)


def weight_bytes(w: "W4A16Weights") -> torch.Tensor:
    """The kernel layout's qweight (int32 [Kp/8, N]) seen as its uint8 [Kp/2, N] bytes."""
    kp8, n = w.qweight.shape
    return w.qweight.view(-1).view(torch.uint8).view(kp8 * 4, n)


def prepare_w4a16(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, group_size: int,
                  perm: torch.Tensor | None = None, pack_k: int = DEFAULT_PACK_K,
                  offsets: torch.Tensor | None = None,
                  superscales: torch.Tensor | None = None) -> W4A16Weights:
    """Standard internal layout (reference.py) -> W4A16Weights. Run once at load, on the weights' device.
    offsets (GGUF Q4_0 / Q4_1 / Q4_K) are cast to the scales' dtype: the loader may hand fp32 scales and offsets
    (Q4_K's sub-scales times super-scales), which the caller casts to the activation dtype (fp16 / bf16) first, as
    for any checkpoint's scales; the kernels read both in one dtype."""
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    gs = k if group_size <= 0 else group_size
    num_groups = scales.shape[0]
    if num_groups != -(-k // gs):
        raise ValueError(f"scales have {num_groups} groups, expected ceil({k}/{gs})")
    check_offsets(offsets, scales, qzeros, superscales)
    if pack_k not in (128, 256, 512):              # pack_k/2 is a dot's K
        raise ValueError(f"pack_k must be 128, 256 or 512, got {pack_k}")
    if num_groups > 1 and gs % (pack_k // 8):
        raise ValueError(f"group size {gs} is not a multiple of pack_k/8 = {pack_k // 8}; use a smaller pack_k")
    kp = -(-k // pack_k) * pack_k
    words = torch.empty((kp // 8, n), dtype=torch.int32, device=qweight.device)
    out = words.view(-1).view(torch.uint8).view(kp // 2, n)
    step = 4096 if n % 4 == 0 else n                      # bounds the temporaries; keeps 4-column groups whole
    for n0 in range(0, n, step):
        codes = unpack_int4_rows(qweight[:, n0:n0 + step])
        codes = torch.cat([codes, codes.new_zeros(kp - k, codes.shape[1])]) if kp > k else codes
        out[:, n0:n0 + step] = _to_bytes(codes, pack_k)
    return W4A16Weights(words, scales.contiguous(), None if qzeros is None else qzeros.contiguous(), gs, k, pack_k,
                        None if perm is None else perm.to(torch.long),
                        None if offsets is None else offsets.to(scales.dtype).contiguous(),
                        None if superscales is None else superscales.contiguous())


def check_offsets(offsets: torch.Tensor | None, scales: torch.Tensor, qzeros: torch.Tensor | None,
                  superscales: torch.Tensor | None = None) -> None:
    """Float offsets must match the scales' [G, N] and exclude integer zero points (reference.py's layout);
    k-quant super-scales go with int16 sub-codes as the scales, nothing else."""
    if superscales is not None:
        if offsets is not None or qzeros is not None:
            raise ValueError("k-quant two-level scales carry their own offsets: no zero points or float offsets")
        check_kquant(scales, superscales)
        return
    if offsets is None:
        return
    if qzeros is not None:
        raise ValueError("a layer has either integer zero points or float offsets, not both")
    if offsets.shape != scales.shape:
        raise ValueError(f"offsets {tuple(offsets.shape)} must have the scales' shape {tuple(scales.shape)}")


def rows_standard(w: W4A16Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Row layout -> (qweight [K/8, N], scales, qzeros, group_size) in the standard layout (the twin's input)."""
    codes = _from_bytes(weight_bytes(w), w.pack_k)[: w.in_features]
    return pack_int4_rows(codes), w.scales, w.qzeros, w.group_size
