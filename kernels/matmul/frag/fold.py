"""The decode step's RMSNorm folded into the INT4 matmuls around it (batch 1, engine/models/decoder.py).

A layer's two norms each cost a launch and a dependent round of loads between two matmuls. Folded, the matmul
that writes the residual stream (o_proj, down_proj) adds the residual in its epilogue and leaves the stream's sums
of squares by FOLD_TILE columns; the next matmul (qkv_proj, gate_up_proj) sums them (fixed order: deterministic)
and normalizes the stream while it stages x (M = 1). Roundings are those of the unfused kernels
(kernels/norm_act.py); only the variance is summed in another order. The Gluon pieces (fold_tiles.py) run inside
the mma kernel (RESIDUAL / NORM); the torch twins below serve the CPU.
"""
import torch

from quant_serve.kernels.attention.merge import DecodePartials
from quant_serve.kernels.gpu import device_sms
from quant_serve.kernels.matmul.frag.fold_tiles import FOLD_TILE, FoldedNorm  # noqa: F401 - FoldedNorm: callers' type
from quant_serve.kernels.matmul.frag.layout import FragWeights
from quant_serve.kernels.matmul.frag.mma import mma_variant, w4a16_mma
from quant_serve.kernels.matmul.plan import mma_config


def folded_norm_applies(w, silu_mul: bool = False) -> bool:
    """Can this layer take part in a decode step whose RMSNorms are folded into the matmuls at M = 1
    (w4a16_residual / w4a16_normed)? The fragment layout without act-order, and a one-launch M = 1 configuration of
    64-column tiles with x staged, which both the residual epilogue (sums of squares by 64 columns) and the norm
    (applied while x is staged) need."""
    if not isinstance(w, FragWeights) or w.perm is not None:
        return False
    k, kp, n = w.in_features, w.words.shape[1] // 2, w.out_features
    cfg = mma_config(1, k, n, w.zp_mode, False, silu_mul)
    if cfg is None or cfg.block_n != FOLD_TILE or cfg.wgmma or not cfg.one_launch:
        return False
    group = w.group_size if w.scales.shape[0] > 1 else 0
    return mma_variant(1, kp, group, cfg.block_n, cfg.block_k, cfg.split_k, False).x_steps > 0


def residual_ref(y: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual epilogue's twin: y [M, N] (the matmul's output) -> (y + residual, sums of its squares by
    FOLD_TILE columns [M, ceil(N / FOLD_TILE)] fp32)."""
    h = y + residual
    hf = torch.nn.functional.pad(h.float(), (0, -h.shape[1] % FOLD_TILE))
    return h, hf.pow(2).reshape(h.shape[0], -1, FOLD_TILE).sum(-1)


def folded_norm_ref(h: torch.Tensor, norm) -> torch.Tensor:
    """The folded norm's twin: RMSNorm(h) * norm.weight with the variance from norm.ss, rounded as rms_norm."""
    variance = norm.ss.sum(-1, keepdim=True) / h.shape[1]
    return norm.weight * (h.float() * torch.rsqrt(variance + norm.eps)).to(h.dtype)


def w4a16_residual(x: torch.Tensor | DecodePartials, w: FragWeights, residual: torch.Tensor,
                   bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K], residual [1, N] -> (h, ss): h = x @ W (+ bias) + residual, rounded as the matmul's output and then
    torch's add round; ss [1, N / 64] fp32 the sums of h^2 by 64 columns (a FoldedNorm's ss). Where
    folded_norm_applies. x may be a batch-1 decode's split partials (kernels/attention/merge.DecodePartials),
    merged while the kernel stages them."""
    k, device = (x.features, x.o.device) if isinstance(x, DecodePartials) else (x.shape[1], x.device)
    cfg = mma_config(1, k, w.out_features, w.zp_mode, sms=device_sms(device))
    return w4a16_mma(x, w, bias, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.one_launch,
                     residual=residual.contiguous(), max_regs=cfg.max_regs)


def w4a16_normed(h: torch.Tensor, w: FragWeights, norm, bias: torch.Tensor | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
    """h [1, K] (a w4a16_residual output), norm a FoldedNorm of its sums -> RMSNorm(h) * weight
    @ W (+ bias), or its SwiGLU with silu_mul. Where folded_norm_applies."""
    cfg = mma_config(1, h.shape[1], w.out_features, w.zp_mode, False, silu_mul, device_sms(h.device))
    return w4a16_mma(h, w, bias, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.one_launch, silu_mul,
                     norm=norm, max_regs=cfg.max_regs)
