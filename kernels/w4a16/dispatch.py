"""W4A16 entry points: the kernel layouts (`prepare_kernel_weights`, at load) and the matmul (`w4a16_matmul`).

On CPU tensors everything runs the torch twin (reference.py) on the standard internal layout. On CUDA the weights
are prepared once at load into one of two layouts (plan.layout_for); passing standard tensors on CUDA repacks on
every call (correct, slow). Each call runs the kernel plan.plan_w4a16 names for its shape on the device's runtime:
Fragment layout (frag.py; fp16 layers with N % 16 == 0, the common case): the Gluon tensor-core kernel (mma.py;
mma.sync up to M = 64, on sm90 wgmma from M = 17 to 128); on sm90 the TMA-fed kernel (tma.py) from M = 17 to 4096;
then a dequantize pass + cuBLAS.
Row layout (rows.py; bf16 and other layers): the Triton kernels of rows_gemv.py / rows_gemm.py:
  gemv     one row per program, CUDA-core FMAs, split-K                      (M = 1..few)
  gemm     tensor-core tiles, split-K when the tiles alone cannot fill the GPU (M = 2..mid); "gemmt" computes
           y^T = W^T x^T (the weight tile is the MMA's M side)
  dequant  Triton dequantize to a dense W, then cuBLAS                          (large M)
"""
from dataclasses import replace

import torch

from quant_serve.kernels.norm_act import silu_and_mul, silu_and_mul_ref
from quant_serve.kernels.w4a16.frag import FragWeights, frag_standard, prepare_frag
from quant_serve.kernels.w4a16.kquant import KQ_GROUP, kquant_scales_offsets
from quant_serve.kernels.w4a16.plan import (KernelPlan, frag_layout_works, frag_offsets_work, layout_for, plan_w4a16,
                                            probed_runtime, w4a8_works)
from quant_serve.kernels.w4a16.reference import w4a16_matmul_ref
from quant_serve.kernels.w4a16.rows import W4A16Weights, prepare_w4a16, rows_standard
from quant_serve.kernels.w4a16.rules import MMAConfig, TMAConfig, W4A16Config
from quant_serve.kernels.w4a8.rules import W4A8Config, int8_planned


def prepare_kernel_weights(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
                           group_size: int, perm: torch.Tensor | None = None,
                           offsets: torch.Tensor | None = None,
                           scale_dtype: torch.dtype | None = None,
                           superscales: torch.Tensor | None = None) -> "W4A16Weights | FragWeights":
    """Standard internal layout -> the layout the GPU kernels read (plan.layout_for on the device's runtime). Run
    once at load, on the weights' device; also runs the device's kernel probes (never first inside a graph).
    offsets [G, N] (GGUF, W = q * s + o) are stored in the scales' dtype. scale_dtype (the activation dtype,
    fp16 / bf16): scales and offsets are cast to it first, as every checkpoint's scales are; the GGUF loader hands
    Q4_K's fp32 scales and offsets (6-bit sub-scales and sub-mins times fp16 super-scales), which fp16 rounds to
    11 significant bits (the products have up to 17). The fragment layout (fp16 scales only) dequantizes with one
    fp16 fma, the row layout in fp32.
    superscales (Q4_K kept two-level, kernels/w4a16/kquant.py): scales are the int16 sub-codes, nothing is cast,
    and scale_dtype names the activation dtype the layout is chosen for (the fragment kernels take fp16 only)."""
    if superscales is not None:
        return _prepare_kquant(qweight, scales, superscales, scale_dtype or torch.float16)
    if scale_dtype is not None:
        scales = scales.to(scale_dtype)
        offsets = None if offsets is None else offsets.to(scale_dtype)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if qweight.device.type != "cuda":
        return prepare_w4a16(qweight, scales, qzeros, group_size, perm, offsets=offsets)
    runtime = probed_runtime(qweight.device)
    layout, _ = layout_for(k, n, group_size, scales.dtype, runtime.caps, runtime.options, offsets is not None,
                           offsets is None or frag_offsets_work(qweight.device))
    if layout == "frag" and frag_layout_works(qweight.device):
        if offsets is None and int8_planned(runtime.caps, runtime.options):
            w4a8_works(qweight.device)                  # its probe at load, never first inside a graph capture
        return prepare_frag(qweight, scales, qzeros, group_size, perm, offsets)
    return prepare_w4a16(qweight, scales, qzeros, group_size, perm, offsets=offsets)


def _prepare_kquant(qweight: torch.Tensor, sub_codes: torch.Tensor, superscales: torch.Tensor,
                    act_dtype: torch.dtype) -> "W4A16Weights | FragWeights":
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if qweight.device.type != "cuda":
        return prepare_w4a16(qweight, sub_codes, None, KQ_GROUP, superscales=superscales)
    runtime = probed_runtime(qweight.device)
    layout, _ = layout_for(k, n, KQ_GROUP, act_dtype, runtime.caps, runtime.options, True,
                           frag_offsets_work(qweight.device, kquant=True))
    if layout == "frag" and frag_layout_works(qweight.device):
        return prepare_frag(qweight, sub_codes, None, KQ_GROUP, superscales=superscales)
    return prepare_w4a16(qweight, sub_codes, None, KQ_GROUP, superscales=superscales)


def twin_args(w: "W4A16Weights | FragWeights") -> tuple:
    """Kernel layout -> (qweight, scales, qzeros, group_size, perm, offsets) for the torch twin (k-quant scales
    expanded to their exact fp32 products)."""
    qweight, scales, qzeros, group_size = standard_layout(w)
    offsets = w.offsets
    if w.superscales is not None:
        scales, offsets = kquant_scales_offsets(scales, w.superscales)
    return qweight, scales, qzeros, group_size, w.perm, offsets


def standard_layout(w: "W4A16Weights | FragWeights") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Kernel layout -> (qweight [K/8, N], scales, qzeros, group_size) in the standard layout (the twin's input);
    the float offsets are `w.offsets`."""
    return frag_standard(w) if isinstance(w, FragWeights) else rows_standard(w)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor | W4A16Weights | FragWeights,
                 scales: torch.Tensor | None = None,
                 qzeros: torch.Tensor | None = None, group_size: int = -1, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, config: W4A16Config | None = None,
                 silu_mul: bool = False, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] fp16/bf16 -> [..., N] in x's dtype. qweight: standard int32 [K/8, N] (with scales, qzeros,
    group_size, perm, offsets) or a prepared layout (the other weight arguments are then ignored). config overrides
    the plan (benchmarks, tests). silu_mul (N = 2I, gate | up): -> [..., I] = silu(gate) * up."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [M, K]
    if not x.is_cuda:
        if isinstance(qweight, (W4A16Weights, FragWeights)):
            qweight, scales, qzeros, group_size, perm, offsets = twin_args(qweight)
        y = w4a16_matmul_ref(x2, qweight, scales, qzeros, group_size, perm, bias, offsets)
        y = silu_and_mul_ref(y) if silu_mul else y
        return y.reshape(*lead, y.shape[-1])
    w = qweight if isinstance(qweight, (W4A16Weights, FragWeights)) else \
        prepare_kernel_weights(qweight, scales, qzeros, group_size, perm, offsets)
    y = w4a16_forward(x2, w, bias, config, silu_mul)
    return y.reshape(*lead, y.shape[-1])


def call_plan(x: torch.Tensor, w: "W4A16Weights | FragWeights", silu_mul: bool = False) -> KernelPlan:
    """The plan a CUDA call of w4a16_forward runs for x [M, K] (after act-order's permutation)."""
    from quant_serve.kernels.w4a16.tma import tma_works_for
    runtime = probed_runtime(x.device)
    m, k = x.shape
    if isinstance(w, FragWeights):
        options = runtime.options
        plan = plan_w4a16(m, k, w.out_features, runtime.caps, options, "frag", x.dtype, silu_mul,
                          tma_works_for(x, w), w.zp_mode, w.group_size)
        if plan.kernel == "w4a8" and not w4a8_works(x.device):     # its probe failed: x stays fp16
            plan = plan_w4a16(m, k, w.out_features, runtime.caps, replace(options, activation_dtype="fp16"),
                              "frag", x.dtype, silu_mul, tma_works_for(x, w), w.zp_mode, w.group_size)
        return plan
    return plan_w4a16(m, k, w.out_features, runtime.caps, runtime.options, "rows", x.dtype, silu_mul)


def w4a16_forward(x: torch.Tensor, w: W4A16Weights | FragWeights, bias: torch.Tensor | None = None,
                  config: W4A16Config | MMAConfig | TMAConfig | W4A8Config | None = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """CUDA path. x: [M, K] -> [M, N], or [M, N/2] = silu(gate) * up with silu_mul (fused into the split-K
    reduce where the kernel has one, else the silu_and_mul kernel after the matmul)."""
    if w.perm is not None:
        x = x[:, w.perm]
    elif x.stride(-1) != 1 or isinstance(w, FragWeights):
        x = x.contiguous()
    if config is None:
        config = call_plan(x, w, silu_mul).config
    if isinstance(w, FragWeights):
        return _frag_forward(x, w, bias, config, silu_mul)
    return _rows_forward(x, w, bias, config, silu_mul)


def _frag_forward(x: torch.Tensor, w: FragWeights, bias: torch.Tensor | None,
                  cfg: MMAConfig | TMAConfig | W4A8Config | None, silu_mul: bool) -> torch.Tensor:
    from quant_serve.kernels.w4a16.frag_tiles import frag_dequantize
    from quant_serve.kernels.w4a16.mma import w4a16_mma
    from quant_serve.kernels.w4a16.tma import w4a16_tma
    from quant_serve.kernels.w4a8.mma import w4a8_forward
    if isinstance(cfg, W4A8Config):             # x quantized to int8, integer tensor cores (kernels/w4a8)
        y = w4a8_forward(x, w, bias, cfg.act_scale, cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps,
                         cfg.warps_m)
        return silu_and_mul(y) if silu_mul else y
    if x.dtype == torch.float16 and isinstance(cfg, TMAConfig):
        return w4a16_tma(x, w, bias, cfg.block_n, cfg.block_m, cfg.block_k, cfg.stages, cfg.consumers,
                         silu_mul=silu_mul, overlap=cfg.overlap)
    if x.dtype == torch.float16 and isinstance(cfg, MMAConfig):
        return w4a16_mma(x, w, bias, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.one_launch,
                         silu_mul, cfg.wgmma, max_regs=cfg.max_regs)
    y = torch.nn.functional.linear(x, frag_dequantize(w).to(x.dtype), bias)
    return silu_and_mul(y) if silu_mul else y


def _rows_forward(x: torch.Tensor, w: W4A16Weights, bias: torch.Tensor | None, cfg: W4A16Config | None,
                  silu_mul: bool) -> torch.Tensor:
    from quant_serve.kernels.w4a16.rows_gemm import w4a16_dequant_matmul, w4a16_gemm
    from quant_serve.kernels.w4a16.rows_gemv import w4a16_gemv
    if cfg is not None and cfg.path == "gemv":
        return w4a16_gemv(x, w, bias, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.one_launch,
                          cfg.pipeline, cfg.rows, silu_mul)
    if cfg is not None and cfg.path in ("gemm", "gemmt"):
        y = w4a16_gemm(x, w, bias, cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages,
                       swap=cfg.path == "gemmt", one_launch=cfg.one_launch)
    else:
        y = w4a16_dequant_matmul(x, w, bias)
    return silu_and_mul(y) if silu_mul else y
