"""Activation quantization for the W4A8 matmul (kernels/matmul/int8/mma.py): x fp16/bf16 [M, K] -> x_q int8 [M, Kp] in the
fragment K order, s_x fp32 [M, blocks]. Plain Triton, so it also runs in the interpreter (the CPU tests).

Numerics are the twin's (reference.quantize_activations): per row and block of act_group channels (K: "token", the
weights' group: "group"), s = amax / 127 (1 for an all-zero block), x_q = round_half_even(x / s) clamped to
+-127, with IEEE division (div_rn, as torch divides) and rounding by adding and subtracting 1.5 * 2^23 (exact for
|v| < 2^22, round to nearest even as cvt.rni), so the kernel's codes and scales equal the twin's bit for bit.

The fragment K order: the W4A8 kernel reads a fragment word's nibbles (kernels/matmul/frag/layout.py) as int8 A operands,
four bytes = four k of one row: lane 4g + t's bytes i = 2 b0 + b2 hold k = 2t + b0 + 8 b2 of a 16-row tile. A dot
product is unchanged when both operands' K is permuted alike, so x_q stores channel 16 c + 2t + b0 + 8 b2 at
position 16 c + 4t + 2 b0 + b2 (`frag_k_order`); its rows are padded with zeros to Kp (the words' packed length,
whose pad rows hold code 0).
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.matmul.reference_int8 import quantize_activations

ROUND_MAGIC = tl.constexpr(12582912.0)     # 1.5 * 2^23: (v + C) - C rounds v to nearest, ties to even (|v| < 2^22)


def frag_k_order(kp: int, device=None) -> torch.Tensor:
    """int64 [Kp]: position p of x_q holds channel frag_k_order(kp)[p] (a permutation inside each 16 channels)."""
    p = torch.arange(kp, device=device)
    local = p % 16
    return p - local + 2 * (local // 4) + (local >> 1) % 2 + 8 * (local % 2)


def quantize_act_ref(x: torch.Tensor, kp: int, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's torch twin: the twin's quantize_activations, its codes padded to Kp and put in the fragment K
    order -> (x_q int8 [M, Kp], s_x fp32 [M, blocks])."""
    xq, sx = quantize_activations(x, act_group)
    xq = torch.nn.functional.pad(xq, (0, kp - xq.shape[1]))
    return xq[:, frag_k_order(kp, xq.device)].contiguous(), sx


@triton.jit
def _quantize_block(x):
    """x fp32 [R, C] -> (codes fp32 [R, C] on the int8 grid, scales fp32 [R]) of each row's block."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = (q + ROUND_MAGIC) - ROUND_MAGIC
    return tl.minimum(tl.maximum(q, -127.0), 127.0), scale


@triton.jit
def _source_channels(p):
    """Positions p of x_q -> the channels they hold (frag_k_order)."""
    local = p % 16
    return p - local + 2 * (local // 4) + (local // 2) % 2 + 8 * (local % 2)


@triton.jit
def _quant_group_kernel(x_ptr, xq_ptr, sx_ptr, K, KP, BLOCKS, stride_xm, stride_qm, stride_sm,
                        GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """One row, GROUPS blocks of GROUP channels a program (grid: M, cdiv(Kp, GROUPS * GROUP))."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)                   # blocks of this program
    p = b[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                   # x_q positions [GROUPS, GROUP]
    k = _source_channels(p)
    x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    q, scale = _quantize_block(x)
    tl.store(xq_ptr + row * stride_qm + p, q.to(tl.int8), mask=p < KP)
    tl.store(sx_ptr + row * stride_sm + b, scale, mask=b < BLOCKS)


@triton.jit
def _quant_token_kernel(x_ptr, xq_ptr, sx_ptr, K, KP, stride_xm, stride_qm, CHUNK: tl.constexpr):
    """One row a program, one scale for all K: the row's amax in a first pass over it, the codes in a second."""
    row = tl.program_id(0).to(tl.int64)
    p0 = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], tl.float32)
    for c in range(0, KP, CHUNK):
        k = _source_channels(c + p0)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, tl.math.div_rn(top, 127.0), 1.0)
    for c in range(0, KP, CHUNK):
        k = _source_channels(c + p0)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        q = (tl.math.div_rn(x, tl.full([CHUNK], 1.0, tl.float32) * scale) + ROUND_MAGIC) - ROUND_MAGIC
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(xq_ptr + row * stride_qm + c + p0, q.to(tl.int8), mask=c + p0 < KP)
    tl.store(sx_ptr + row, scale)


def quantize_act(x: torch.Tensor, kp: int, act_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16 / bf16 (unit stride along K) -> (x_q int8 [M, Kp] in the fragment K order, s_x fp32 [M, blocks]).
    act_group: K (one scale a row) or a power of two >= 16 dividing Kp's blocks (the weights' group)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = -(-k // act_group)
    xq = torch.empty((m, kp), dtype=torch.int8, device=x.device)
    sx = torch.empty((m, blocks), dtype=torch.float32, device=x.device)
    if m == 0:
        return xq, sx
    if act_group >= k:
        chunk = min(1024, triton.next_power_of_2(kp))
        _quant_token_kernel[(m,)](x, xq, sx, k, kp, x.stride(0), xq.stride(0), CHUNK=chunk, num_warps=4)
        return xq, sx
    if act_group & (act_group - 1) or act_group < 16:
        raise ValueError(f"activation blocks of {act_group} channels: the kernel takes powers of two >= 16")
    groups = max(1, min(16, 2048 // act_group))
    grid = (m, triton.cdiv(kp, groups * act_group))
    _quant_group_kernel[grid](x, xq, sx, k, kp, blocks, x.stride(0), xq.stride(0), sx.stride(0),
                              GROUP=act_group, GROUPS=groups, num_warps=4)
    return xq, sx
