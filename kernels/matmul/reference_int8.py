"""Torch twin of the W4A8 matmul: what the int8-activation kernels compute, over the internal INT4 layout
(kernels/matmul/reference.py).

Activations are quantized symmetrically to int8 per row, in blocks of `act_group` input channels along K:
    s_x[m, b] = max_k |x[m, k]| / 127 over block b (1 where the block is all zeros),  x_q = round(x / s_x)
act_group is K (one scale per token) or the weights' group size (one scale per row and weight group; GGUF's
groups of 32 give llama.cpp's Q8_1 blocks). The matmul then sums exact integer products per weight group g:
    integer zero points:  y[m, n] = sum_g s_w[g, n] s_x[m, g] sum_{k in g} x_q[m, k] (q[k, n] - z[g, n])
    float offsets (GGUF): y[m, n] = sum_g s_x[m, g] (s_w[g, n] sum_{k in g} x_q q + o[g, n] sum_{k in g} x_q)
accumulated in fp32 and rounded once to x's dtype.
"""
import torch

from quant_serve.kernels.matmul.reference import unpack_int4_cols, unpack_int4_rows

ACT_SCALES = ("token", "group")      # the granularity of the activation scales: per row, or per row and weight group


def act_group_size(act_scale: str, in_features: int, group_size: int) -> int:
    """Input channels per activation scale: K for "token", the weights' group size for "group"."""
    if act_scale not in ACT_SCALES:
        raise ValueError(f"unknown activation scale granularity {act_scale!r}; choose one of {', '.join(ACT_SCALES)}")
    gs = in_features if group_size <= 0 else group_size
    return in_features if act_scale == "token" else gs


def quantize_activations(x: torch.Tensor, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q int8 [M, K], s_x fp32 [M, ceil(K / act_group)]). Symmetric, round half to even
    (torch.round, as the kernels' cvt.rni)."""
    m, k = x.shape
    blocks = -(-k // act_group)
    xf = torch.nn.functional.pad(x.float(), (0, blocks * act_group - k)).view(m, blocks, act_group)
    amax = xf.abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))                 # [M, blocks]
    xq = torch.round(xf / scale[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return xq.view(m, -1)[:, :k].contiguous(), scale


def w4a8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                    group_size: int, act_group: int, perm: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype. act_group: K, or a multiple of the weights' group size."""
    lead, k = x.shape[:-1], x.shape[-1]
    gs = k if group_size <= 0 else group_size
    if act_group != k and act_group % gs:
        raise ValueError(f"activation blocks of {act_group} channels do not cover whole weight groups of {gs}")
    if perm is not None:
        x = x[..., perm]
    x2 = x.reshape(-1, k)
    xq, sx = quantize_activations(x2, act_group)
    q = unpack_int4_rows(qweight)[:k]                                            # [K, N] codes
    n, groups = q.shape[1], scales.shape[0]
    if offsets is None:
        z = unpack_int4_cols(qzeros)[:, :n] if qzeros is not None else torch.full((groups, n), 8, dtype=torch.int32)
        w_int = q - z.to(q.device).repeat_interleave(gs, dim=0)[:k]              # (q - z), |.| <= 15
    else:
        w_int = q
    # per weight group: integer sums, exact in fp32 (|sum| <= 127 * 15 * group < 2^24 for groups up to 8192)
    pad = groups * gs - k
    xg = torch.nn.functional.pad(xq.float(), (0, pad)).view(-1, groups, gs).transpose(0, 1)      # [G, M, gs]
    wg = torch.nn.functional.pad(w_int.float(), (0, 0, 0, pad)).view(groups, gs, n)            # [G, gs, N]
    sums = torch.bmm(xg, wg)                                                                  # [G, M, N]
    sx_g = sx[:, torch.arange(groups, device=sx.device) * gs // act_group].t()[:, :, None]    # [G, M, 1]
    y = (sums * scales.float()[:, None, :] * sx_g).sum(0)
    if offsets is not None:
        y = y + (xg.sum(2, keepdim=True) * offsets.float()[:, None, :] * sx_g).sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, n)
