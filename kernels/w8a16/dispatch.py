"""W8A16 entry point (`w8a16_matmul`). CPU tensors run the torch twin (reference.py); CUDA tensors the kernel
plan.plan_w8a16 names (kernels.py): the split-K GEMV up to M = 16, dequantize + cuBLAS above."""
import torch

from quant_serve.kernels.w4a16.frag import FragWeights
from quant_serve.kernels.w8a16.plan import W8A16Config, plan_w8a16
from quant_serve.kernels.w8a16.q5k import Q5_GROUP, Q5KWeights, q5k_codes, q5k_dequantize
from quant_serve.kernels.w8a16.q6k import Q6_GROUP, Q6KWeights, q6k_codes, q6k_dequantize, q6k_scales
from quant_serve.kernels.w8a16.reference import w8a16_matmul_ref


def prepare_q6k(w: Q6KWeights, act_dtype: torch.dtype) -> "Q6KWeights | FragWeights":
    """Q6_K planes -> the layout its GPU kernels read, once at load: on CUDA with fp16 activations, N % 16 == 0 and
    the W4A16 tensor-core kernels probed right for Q6_K, the fragment layout (kernels/w4a16/frag6.py: 7 bits a
    weight, ~4 SASS instructions a weight against 11-13 in the plane GEMV); otherwise the planes."""
    from quant_serve.kernels.w4a16.plan import frag6_works
    if not w.planes.is_cuda or act_dtype != torch.float16 or w.out_features % 16 or w.in_features % 16 \
            or not frag6_works(w.planes.device):
        return w
    return q6k_to_frag6(w)


def q6k_to_frag6(w: Q6KWeights, max_elems: int = 1 << 26) -> FragWeights:
    """Q6_K planes -> the fragment layout, converted in column chunks of at most max_elems weights (a multiple of
    16 columns), so a 152k-row head's int32 temporaries stay near 256 MB."""
    from quant_serve.kernels.w4a16.frag6 import pack_frag6
    k, n = w.in_features, w.out_features
    step = max(16, max_elems // k // 16 * 16)
    parts = [pack_frag6(q6k_codes(part), q6k_scales(part))
             for part in (Q6KWeights(w.planes[:, c:c + step], w.sub_scales[:, c:c + step], w.d[:, c:c + step])
                          for c in range(0, n, step))]
    return FragWeights(torch.cat([p.words for p in parts]), torch.cat([p.scales for p in parts], dim=1), None, 16,
                       k, n, hi=torch.cat([p.hi for p in parts]))


def prepare_q5k(w: Q5KWeights, act_dtype: torch.dtype) -> "Q5KWeights | FragWeights":
    """Q5_K planes -> the layout its GPU kernels read, once at load: on CUDA with fp16 activations, N % 16 == 0 and
    the W4A16 tensor-core kernels probed right for Q5_K, the fragment layout (kernels/w4a16/frag5.py: 6 bits a
    weight against the planes' 5.625, the tensor-core kernels instead of the plane GEMV); otherwise the planes."""
    from quant_serve.kernels.w4a16.plan import frag5_works
    if not w.planes.is_cuda or act_dtype != torch.float16 or w.out_features % 16 or w.in_features % 64 \
            or not frag5_works(w.planes.device):
        return w
    return q5k_to_frag5(w)


def q5k_to_frag5(w: Q5KWeights, max_elems: int = 1 << 26) -> FragWeights:
    """Q5_K planes -> the fragment layout, in column chunks as q6k_to_frag6."""
    from quant_serve.kernels.w4a16.frag5 import pack_frag5, q5k_pairs
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
    from quant_serve.kernels.w8a16.kernels import w8a16_dequant_matmul, w8a16_gemv
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
