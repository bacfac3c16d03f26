"""The matmul entry points of the quantized layers: INT4 weights (`prepare_kernel_weights` at load, `w4a16_matmul` /
`w4a16_forward` per call, with fp16 or int8 activations as the plan says) and 8-bit codes / GGUF code planes
(`prepare_q6k`, `prepare_q5k` at load, `w8a16_matmul` / `w8a16_forward`).

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
import functools
from dataclasses import replace

import torch

from quant_serve.kernels.gpu import KernelOptions
from quant_serve.kernels.matmul.frag.kquant import KQ_GROUP, kquant_scales_offsets
from quant_serve.kernels.matmul.frag.layout import FragWeights, frag_standard, prepare_frag
from quant_serve.kernels.matmul.int8.rules import W4A8Config, int8_planned
from quant_serve.kernels.matmul.plan import KernelPlan, W8A16Config, layout_for, plan_w4a16, plan_w8a16
from quant_serve.kernels.matmul.planes.q5k import Q5_GROUP, Q5KWeights, q5k_codes, q5k_dequantize
from quant_serve.kernels.matmul.planes.q6k import Q6_GROUP, Q6KWeights, q6k_codes, q6k_dequantize, q6k_scales
from quant_serve.kernels.matmul.probes import frag_layout_works, frag_offsets_work, probed_runtime, w4a8_works
from quant_serve.kernels.matmul.reference import w4a16_matmul_ref
from quant_serve.kernels.matmul.reference_planes import w8a16_matmul_ref
from quant_serve.kernels.matmul.rows.layout import W4A16Weights, prepare_w4a16, rows_standard
from quant_serve.kernels.matmul.rules import MMAConfig, TMAConfig, W4A16Config
from quant_serve.kernels.norm_act import silu_and_mul, silu_and_mul_ref


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
    superscales (Q4_K kept two-level, kernels/matmul/frag/kquant.py): scales are the int16 sub-codes, nothing is cast,
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


def layer_options(options: KernelOptions, w: FragWeights) -> KernelOptions:
    """The runtime's options as one layer's plan reads them (FragWeights.activation_dtype: fp16 where the layer's
    weight format has not met the int8 accuracy gate)."""
    if w.activation_dtype is None or w.activation_dtype == options.activation_dtype:
        return options
    return _with_activation(options, w.activation_dtype)


@functools.lru_cache(maxsize=8)
def _with_activation(options: KernelOptions, activation_dtype: str) -> KernelOptions:
    return replace(options, activation_dtype=activation_dtype)     # once, not on every call of every layer


def call_plan(x: torch.Tensor, w: "W4A16Weights | FragWeights", silu_mul: bool = False) -> KernelPlan:
    """The plan a CUDA call of w4a16_forward runs for x [M, K] (after act-order's permutation)."""
    from quant_serve.kernels.matmul.frag.tma import tma_works_for
    runtime = probed_runtime(x.device)
    m, k = x.shape
    if isinstance(w, FragWeights):
        options = layer_options(runtime.options, w)
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
    from quant_serve.kernels.matmul.frag.tiles import frag_dequantize
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    from quant_serve.kernels.matmul.int8.mma import w4a8_forward
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
    from quant_serve.kernels.matmul.rows.gemm import w4a16_dequant_matmul, w4a16_gemm
    from quant_serve.kernels.matmul.rows.gemv import w4a16_gemv
    if cfg is not None and cfg.path == "gemv":
        return w4a16_gemv(x, w, bias, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages, cfg.one_launch,
                          cfg.pipeline, cfg.rows, silu_mul)
    if cfg is not None and cfg.path in ("gemm", "gemmt"):
        y = w4a16_gemm(x, w, bias, cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps, cfg.num_stages,
                       swap=cfg.path == "gemmt", one_launch=cfg.one_launch)
    else:
        y = w4a16_dequant_matmul(x, w, bias)
    return silu_and_mul(y) if silu_mul else y


# ---- 8-bit codes and GGUF code planes --------------------------------------------------------------------------------

def prepare_q6k(w: Q6KWeights, act_dtype: torch.dtype) -> "Q6KWeights | FragWeights":
    """Q6_K planes -> the layout its GPU kernels read, once at load: on CUDA with fp16 activations, N % 16 == 0 and
    the W4A16 tensor-core kernels probed right for Q6_K, the fragment layout (kernels/matmul/frag/q6k.py: 7 bits a
    weight, ~4 SASS instructions a weight against 11-13 in the plane GEMV); otherwise the planes."""
    from quant_serve.kernels.matmul.probes import frag6_works
    if not w.planes.is_cuda or act_dtype != torch.float16 or w.out_features % 16 or w.in_features % 16 \
            or not frag6_works(w.planes.device):
        return w
    return q6k_to_frag6(w)


def q6k_to_frag6(w: Q6KWeights, max_elems: int = 1 << 26) -> FragWeights:
    """Q6_K planes -> the fragment layout, converted in column chunks of at most max_elems weights (a multiple of
    16 columns), so a 152k-row head's int32 temporaries stay near 256 MB."""
    from quant_serve.kernels.matmul.frag.q6k import pack_frag6
    k, n = w.in_features, w.out_features
    step = max(16, max_elems // k // 16 * 16)
    parts = [pack_frag6(q6k_codes(part), q6k_scales(part))
             for part in (Q6KWeights(w.planes[:, c:c + step], w.sub_scales[:, c:c + step], w.d[:, c:c + step])
                          for c in range(0, n, step))]
    return FragWeights(torch.cat([p.words for p in parts]), torch.cat([p.scales for p in parts], dim=1), None, 16,
                       k, n, hi=torch.cat([p.hi for p in parts]))


def prepare_q5k(w: Q5KWeights, act_dtype: torch.dtype) -> "Q5KWeights | FragWeights":
    """Q5_K planes -> the layout its GPU kernels read, once at load: on CUDA with fp16 activations, N % 16 == 0 and
    the W4A16 tensor-core kernels probed right for Q5_K, the fragment layout (kernels/matmul/frag/q5k.py: 6 bits a
    weight against the planes' 5.625, the tensor-core kernels instead of the plane GEMV); otherwise the planes."""
    from quant_serve.kernels.matmul.probes import frag5_works
    if not w.planes.is_cuda or act_dtype != torch.float16 or w.out_features % 16 or w.in_features % 64 \
            or not frag5_works(w.planes.device):
        return w
    return q5k_to_frag5(w)


def q5k_to_frag5(w: Q5KWeights, max_elems: int = 1 << 26) -> FragWeights:
    """Q5_K planes -> the fragment layout, in column chunks as q6k_to_frag6."""
    from quant_serve.kernels.matmul.frag.q5k import pack_frag5, q5k_pairs
    k, n = w.in_features, w.out_features
    step = max(16, max_elems // k // 16 * 16)
    parts = [pack_frag5(q5k_codes(part), q5k_pairs(part.sub_codes, part.superscales))
             for part in (Q5KWeights(w.planes[:, c:c + step], w.sub_codes[:, c:c + step],
                                     w.superscales[:, c:c + step]) for c in range(0, n, step))]
    return FragWeights(torch.cat([p.words for p in parts]), torch.cat([p.scales for p in parts], dim=1), None, 32,
                       k, n, hi=torch.cat([p.hi for p in parts]))


def check_w8_layout(k: int, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    group_size: int) -> None:
    """Bad weights -> a ValueError naming the problem (reference.py's layout)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"W8A16 qweight must be int8 [K, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if qweight.shape[0] != k:
        raise ValueError(f"x has K = {k} features but qweight has {qweight.shape[0]} rows")
    groups = -(-k // group_size) if 0 < group_size < k else 1
    if tuple(scales.shape) != (groups, qweight.shape[1]):
        raise ValueError(f"scales {tuple(scales.shape)} must be [{groups}, {qweight.shape[1]}] for K = {k} in groups "
                         f"of {group_size}")
    if offsets is not None and offsets.shape != scales.shape:
        raise ValueError(f"offsets {tuple(offsets.shape)} must have the scales' shape {tuple(scales.shape)}")


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None,
                 config: W8A16Config | None = None) -> torch.Tensor:
    """x: [..., K] fp16/bf16 -> [..., N] in x's dtype; weights in the layout of reference.py (scales and offsets in
    any float dtype: the kernels dequantize in fp32; fp16 halves their traffic next to fp32). config overrides the
    plan (benchmarks, tests). qweight may be Q6KWeights (GGUF Q6_K at 6 bits, q6k.py) or Q5KWeights (GGUF Q5_K at
    5 bits, q5k.py); scales, offsets ignored."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])                                                  # [M, K]
    if isinstance(qweight, (Q6KWeights, Q5KWeights)):
        q6 = isinstance(qweight, Q6KWeights)
        if x2.shape[1] != qweight.in_features:
            raise ValueError(f"x has K = {x2.shape[1]} features but the {'Q6_K' if q6 else 'Q5_K'} weights have "
                             f"{qweight.in_features}")
        if not x.is_cuda:
            y = x2.float() @ (q6k_dequantize(qweight) if q6 else q5k_dequantize(qweight))
            y = (y + bias.float() if bias is not None else y).to(x.dtype)
            return y.reshape(*lead, y.shape[-1])
        y = w8a16_forward(x2, qweight, None, None, Q6_GROUP if q6 else Q5_GROUP, bias, config)
        return y.reshape(*lead, y.shape[-1])
    if not x.is_cuda:
        y = w8a16_matmul_ref(x2, qweight, scales, offsets, group_size, bias)
        return y.reshape(*lead, y.shape[-1])
    check_w8_layout(x2.shape[1], qweight, scales, offsets, group_size)
    y = w8a16_forward(x2, qweight, scales, offsets, group_size, bias, config)
    return y.reshape(*lead, y.shape[-1])


def w8a16_forward(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                  group_size: int, bias: torch.Tensor | None = None,
                  config: W8A16Config | None = None) -> torch.Tensor:
    """Kernel path (CUDA, or the Triton interpreter in tests). x: [M, K] -> [M, N]."""
    from quant_serve.kernels.gpu import device_sms
    from quant_serve.kernels.matmul.planes.kernels import w8a16_dequant_matmul, w8a16_gemv
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = qweight.out_features if isinstance(qweight, (Q6KWeights, Q5KWeights)) else qweight.shape[1]
    if config is None:
        layout = "q6k" if isinstance(qweight, Q6KWeights) else "q5k" if isinstance(qweight, Q5KWeights) else "int8"
        config = plan_w8a16(m, k, n, group_size, device_sms(x.device), layout).config
    if config.path == "gemv":
        return w8a16_gemv(x, qweight, scales, offsets, group_size, bias, config.block_m, config.block_n,
                          config.block_k, config.split_k, config.num_warps, config.one_launch)
    return w8a16_dequant_matmul(x, qweight, scales, offsets, group_size, bias)
