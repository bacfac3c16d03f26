"""Round-to-nearest INT4 quantizer (formats.md math). The baseline the calibrated quantizers are measured against,
the group quantizer that AWQ and GPTQ call, and the source of realistic codes for the format writers' tests."""
import math
from dataclasses import dataclass

import torch

MAXQ = 15


@dataclass
class QuantResult:
    """One quantized Linear, ready for a format writer."""
    q: torch.Tensor                       # int32 [N, K] codes 0..15, original K order
    scales: torch.Tensor                  # fp32 [G, N]
    zeros: torch.Tensor | None            # int32 [G, N] real zeros, None = symmetric (z = 8)
    g_idx: torch.Tensor | None = None     # int32 [K] act-order groups, None = k // G
    bias: torch.Tensor | None = None      # [N]

    def dequantize(self, group_size: int) -> torch.Tensor:
        return dequantize_codes(self.q, self.scales, self.zeros, group_size, self.g_idx)


def group_params(wmin: torch.Tensor, wmax: torch.Tensor, sym: bool, scale_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group range -> (scale, zero) as fp32 tensors of the same shape. The range is widened to include 0.

    scale_dtype: round the scales to the dtype the checkpoint stores (fp16) before the zeros and codes are
    derived from them, so that what the writer stores is exactly what the quantizer measured.
    """
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    if sym:
        scale = 2 * torch.maximum(-wmin, wmax) / MAXQ
    else:
        scale = (wmax - wmin) / MAXQ
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # an all-zero group: any scale is exact
    if sym:
        zero = torch.full_like(scale, (MAXQ + 1) // 2)
    else:
        zero = torch.clamp(torch.round(-wmin / scale), 0, MAXQ)
    return scale, zero


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                 clip: torch.Tensor | None = None, scale_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """weight [N, K] -> (q [N, K] int32 codes 0..15 in original K order, scales [G, N] fp32, zeros [G, N] int32 or
    None when sym (z = 8)).

    asym: range widened to include 0, s = (max - min) / 15, z = clamp(round(-min / s), 0, 15).
    sym (GPTQ convention): s = 2 * max|w| / 15, z = 8. q = clamp(round(w / s) + z, 0, 15).
    clip: shrink ratios of each group's range (AWQ's clipping search): [N, G] for both ends, or [2, N, G] for
    the min and the max separately.
    """
    if bits != 4:
        raise ValueError(f"only 4-bit RTN is supported, got {bits}")
    n, k = weight.shape
    grouped, g = _grouped(weight.detach().float(), group_size)          # [N, G, gs]
    wmin, wmax = _clipped_range(grouped, clip)
    scales, zeros = group_params(wmin, wmax, sym, scale_dtype)
    q = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, MAXQ)
    q = q.view(n, -1)[:, :k].to(torch.int32)
    return q, scales.t().contiguous(), None if sym else zeros.t().to(torch.int32).contiguous()


def fake_quantize(weight: torch.Tensor, group_size: int, sym: bool, clip: torch.Tensor | None = None,
                  scale_dtype: torch.dtype | None = torch.float16) -> torch.Tensor:
    """Quantize-dequantize [N, K] -> fp32 [N, K] (what the checkpoint will hold), for the calibration searches."""
    n, k = weight.shape
    grouped, _ = _grouped(weight.float(), group_size)
    wmin, wmax = _clipped_range(grouped, clip)
    scale, zero = group_params(wmin, wmax, sym, scale_dtype)
    scale, zero = scale[..., None], zero[..., None]
    q = torch.clamp(torch.round(grouped / scale) + zero, 0, MAXQ)
    return ((q - zero) * scale).view(n, -1)[:, :k]


def search_clip(weight: torch.Tensor, blocks: torch.Tensor, group_size: int, sym: bool, ratios: list[float],
                two_d: bool = True) -> tuple[torch.Tensor, float]:
    """Per (output row, group) shrink of the range minimizing that group's share of the layer's output error,
    d^T G_g d, d = Q(w) - w, with G_g [gs, gs] the group's diagonal block of X^T X (blocks [G, gs, gs]).
    Asymmetric ranges may shrink min and max independently (two_d: a grid over scale and zero point).
    -> (ratios [2, N, G] for (min, max), error relative to the unclipped range)."""
    n, k = weight.shape
    grouped, ng = _grouped(weight.float(), group_size)
    grouped = grouped.transpose(0, 1).contiguous()            # [G, N, gs]: one batched matmul with the blocks
    wmin, wmax = grouped.amin(dim=-1), grouped.amax(dim=-1)   # [G, N], computed once for every candidate
    pairs = [(lo, hi) for lo in ratios for hi in ratios] if two_d and not sym else [(r, r) for r in ratios]
    best = torch.ones(2, ng, n, device=weight.device)
    best_err = torch.full((ng, n), float("inf"), device=weight.device)
    diff, prod = torch.empty_like(grouped), torch.empty_like(grouped)
    base = None
    for lo, hi in pairs:
        # fake_quantize's arithmetic, in place: the candidates are many and the weight tensors large
        scale, zero = group_params(wmin * lo, wmax * hi, sym, torch.float16)
        scale, zero = scale[..., None], zero[..., None]
        torch.div(grouped, scale, out=diff)
        diff.round_().add_(zero).clamp_(0, MAXQ).sub_(zero).mul_(scale).sub_(grouped)
        err = torch.bmm(diff, blocks, out=prod).mul_(diff).sum(-1)                        # [G, N]
        if lo == hi == 1:
            base = float(err.sum())
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best[0].masked_fill_(better, lo)
        best[1].masked_fill_(better, hi)
    return best.transpose(1, 2).contiguous(), float(best_err.sum()) / max(base or 0.0, 1e-30)


def _clipped_range(grouped: torch.Tensor, clip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    wmin, wmax = grouped.amin(dim=-1), grouped.amax(dim=-1)                          # [N, G]
    if clip is None:
        return wmin, wmax
    lo, hi = (clip[0], clip[1]) if clip.dim() == 3 else (clip, clip)
    return wmin * lo, wmax * hi


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """[N, K] -> [N, G, gs], the last group padded with zeros (inside every range)."""
    n, k = w.shape
    gs = k if group_size <= 0 else group_size
    g = math.ceil(k / gs)
    if k % gs:
        w = torch.nn.functional.pad(w, (0, g * gs - k))
    return w.reshape(n, g, gs), g


def dequantize_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """W[n, k] = (q[n, k] - z[g(k), n]) * s[g(k), n], g(k) = g_idx[k] or k // G (z = 8 when None). -> fp32 [N, K]."""
    k = q.shape[1]
    gs = k if group_size <= 0 else group_size
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // gs
    z = zeros[groups] if zeros is not None else torch.full((k, q.shape[0]), 8, device=q.device)
    return (q.t() - z).float().mul(scales.float()[groups]).t()
