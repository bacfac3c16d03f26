"""Fused RMSNorm (optionally with the residual add) and SiLU-and-mul: Triton on CUDA, the torch twins below on CPU.

A decode step of a 7B model is ~30 small elementwise kernels per layer when written as torch ops (casts, pow,
mean, rsqrt, muls, the residual add); these two kernels replace them with two launches per layer. The numerics are
those of the Hugging Face Llama/Qwen2 code, which the twins spell out: the residual add rounds to the model dtype,
the norm runs in fp32, rounds to the model dtype, then multiplies by the weight in the model dtype; SiLU runs in
fp32, rounds, then multiplies `up` in the model dtype.
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.pdl import launch_options, pdl_enabled, pdl_start, pdl_wait


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """x: [T, H] -> normed [T, H]; with residual [T, H]: (normed(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Same contract as rms_norm_ref."""
    if not x.is_cuda or x.dtype != weight.dtype:
        return rms_norm_ref(x, weight, eps, residual)
    return rms_norm_triton(x, weight, eps, residual)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (and residual): [T, H] with unit stride along H."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else out
    pdl = pdl_enabled(x)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, new_residual, hidden, eps,
        x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
        HAS_RESIDUAL=residual is not None, PDL=pdl, BLOCK=triton.next_power_of_2(hidden), num_warps=_warps(hidden),
        **launch_options(pdl))
    return out if residual is None else (out, new_residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not gate_up.is_cuda:
        return silu_and_mul_ref(gate_up)
    return silu_and_mul_triton(gate_up)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(inter))
    pdl = pdl_enabled(gate_up)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), PDL=pdl, BLOCK=block, num_warps=4,
        **launch_options(pdl))
    return out


def _warps(hidden: int) -> int:
    return 4 if hidden <= 2048 else 8


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, new_r_ptr, H, eps, stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)               # a weight: read before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)        # torch's fp16/bf16 add
        tl.store(new_r_ptr + row * stride_o + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(x_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, inter, stride_in, stride_out, PDL: tl.constexpr, BLOCK: tl.constexpr):
    pdl_start(PDL)                                                # kernels/pdl.py: a short kernel lets the next in
    pdl_wait(PDL)                                                 # at once and reads nothing before the wait
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(in_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + inter + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * stride_out + offs, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)
