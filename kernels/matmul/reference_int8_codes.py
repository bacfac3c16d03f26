"""Torch twin of the W8A8 matmul: 8-bit weight codes (GGUF Q8_0 / Q5_0 / Q5_1 / Q5_K / Q6_K, the layout of
kernels/matmul/reference_planes.py) times activations quantized on the fly to int8, as reference.py defines them for INT4.

Activations: quantize_activations (symmetric per row, int8, scale amax / 127) in blocks of act_group channels: K
("token") or the weights' group size, never finer than W8_MIN_ACT_GROUP (llama.cpp's Q8_1 blocks of 32 serve its
Q6_K groups of 16 too). Per weight group g, exact integer sums:
    y[m, n] = sum_g s_x[m, g] (s_w[g, n] sum_{k in g} x_q[m, k] q[k, n] + o[g, n] sum_{k in g} x_q[m, k])
accumulated in fp32 (o = 0 without offsets) and rounded once to x's dtype.
"""
import torch

from quant_serve.kernels.matmul.reference_int8 import ACT_SCALES, quantize_activations

W8_MIN_ACT_GROUP = 32          # activation scales per 32 channels at the finest, as llama.cpp's Q8_1 activations
_MAX_EXACT_GROUP = 1024        # 127 * 127 * 1024 < 2^24: a group's integer sum is exact in fp32
_CHUNK_ELEMS = 1 << 24         # groups at a time: [groups, M, N] fp32 partial sums of at most 64 MiB


def w8_act_group_size(act_scale: str, in_features: int, group_size: int) -> int:
    """Input channels per activation scale of an 8-bit layer: K for "token"; for "group" the weights' group size,
    at least W8_MIN_ACT_GROUP channels (a multiple of the group, so a block covers whole weight groups)."""
    if act_scale not in ACT_SCALES:
        raise ValueError(f"unknown activation scale granularity {act_scale!r}; choose one of {', '.join(ACT_SCALES)}")
    gs = in_features if group_size <= 0 else group_size
    if act_scale == "token":
        return in_features
    return gs * -(-W8_MIN_ACT_GROUP // gs) if gs < W8_MIN_ACT_GROUP else gs


def w8a8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    group_size: int, act_group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] -> [..., N] in x's dtype. codes: integer [K, N] with |q| <= 127 (int8 codes, Q6_K's -32..31,
    Q5_K's 0..31); scales, offsets: [G, N]; act_group: K, or a multiple of group_size."""
    lead, k = x.shape[:-1], x.shape[-1]
    gs = k if group_size <= 0 else group_size
    if gs > _MAX_EXACT_GROUP:
        raise ValueError(f"weight groups of {gs} channels: integer sums would not be exact in fp32 "
                         f"(at most {_MAX_EXACT_GROUP})")
    if act_group != k and act_group % gs:
        raise ValueError(f"activation blocks of {act_group} channels do not cover whole weight groups of {gs}")
    xq, sx = quantize_activations(x.reshape(-1, k), act_group)
    m, n, groups = xq.shape[0], codes.shape[1], scales.shape[0]
    pad = groups * gs - k
    xg = torch.nn.functional.pad(xq.float(), (0, pad)).view(m, groups, gs).transpose(0, 1)      # [G, M, gs]
    wg = torch.nn.functional.pad(codes.float(), (0, 0, 0, pad)).view(groups, gs, n)            # [G, gs, N]
    sx_g = sx[:, torch.arange(groups, device=sx.device) * gs // act_group].t()[:, :, None]    # [G, M, 1]
    s = scales.float()[:, None, :]                                                            # [G, 1, N]
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    step = max(1, _CHUNK_ELEMS // max(1, m * n))
    for g in range(0, groups, step):
        part = torch.bmm(xg[g:g + step], wg[g:g + step]) * s[g:g + step]                      # [g, M, N]
        if offsets is not None:
            part = part + xg[g:g + step].sum(2, keepdim=True) * offsets.float()[g:g + step, None, :]
        y += (part * sx_g[g:g + step]).sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, n)
