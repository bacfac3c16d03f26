"""The batch-1 decode step with every RMSNorm folded into the INT4 matmuls around it: the whole fused layer.

A Llama-style layer (ModelConfig.llama_block) at one token a step reads, per layer:

    qkv   = normed(qkv_proj, stream, input_layernorm)            norm applied while the kernel stages x
    a     = attention(qkv)                                        split partials, not merged (KernelOptions.fold_merge)
    stream, ss = residual(o_proj, a, stream)                      merges a's partials as it stages them; adds the
                                                                  residual in its epilogue and leaves the stream's
                                                                  sums of squares by 64 columns (ss)
    act   = normed(gate_up_proj, stream, post_attention_layernorm, ss), SwiGLU in the split-K reduce
    stream, ss = residual(down_proj, act, stream)

Against DecoderModel.forward's path this is two norm launches and one merge launch a layer fewer, with the same
roundings (the variance is summed in another order, fp32). The kernels are kernels/matmul/frag/fold.py's launchers of the
mma kernel; on CPU, or where a layer's layout cannot fold, their torch twins run, so the order of operations is
testable anywhere (tests/kernels/test_fold_norm.py). QuantLinear knows nothing of this: it loads and does a plain forward.
"""
import weakref

import torch
from torch import nn

from quant_serve.kernels.attention.merge import DecodePartials, merge_partials
from quant_serve.kernels.gpu import options_for
from quant_serve.kernels.matmul.frag.fold import (FoldedNorm, folded_norm_applies, folded_norm_ref, residual_ref,
                                                  w4a16_normed, w4a16_residual)
from quant_serve.quant.layers.linear import QuantLinear

_KERNEL_FOLDS: "weakref.WeakKeyDictionary[QuantLinear, dict[bool, bool]]" = weakref.WeakKeyDictionary()


def applies(model, x: torch.Tensor) -> bool:
    """Does this step take the fused path: one token on CUDA, KernelOptions.fold_norms on, a Llama-style block, and
    every matmul of every layer an INT4 layer whose layout folds (kernel_folds) with nothing observing it (eval's
    per-layer error hooks must see each layer called on its own)."""
    if x.shape[0] != 1 or not x.is_cuda or not model.folds_norms or not options_for(x.device).fold_norms:
        return False
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear, silu_mul in ((attn.qkv_proj, False), (attn.o_proj, False), (mlp.gate_up_proj, True),
                                 (mlp.down_proj, False)):
            if not isinstance(linear, QuantLinear) or _observed(linear) or not kernel_folds(linear, silu_mul):
                return False
    return True


def kernel_folds(linear: QuantLinear, silu_mul: bool = False) -> bool:
    """The layer's kernel layout can fold a norm (kernels/matmul/frag/fold.py:folded_norm_applies): the fragment layout,
    no act-order parts. Asked once per layer and answer (the layout is fixed after load)."""
    if linear.parts is not None or linear.packed is None:
        return False
    answers = _KERNEL_FOLDS.setdefault(linear, {})
    if silu_mul not in answers:
        answers[silu_mul] = folded_norm_applies(linear.packed, silu_mul)
    return answers[silu_mul]


def forward(model, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
    """x: the embedded token [1, hidden] -> the final-normed hidden state [1, hidden]. The first layer's qkv_proj
    reads the plain norm (there is no previous epilogue to leave sums of squares)."""
    merge = not options_for(x.device).fold_merge
    stream = x
    first = model.layers[0]
    qkv = first.self_attn.qkv_proj(first.input_layernorm(x))
    ss = None
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if i > 0:
            qkv = normed(attn.qkv_proj, stream, _fold(ss, layer.input_layernorm))
        a = attn.attend(positions, qkv, meta, model.rotary, merge)
        stream, ss = residual(attn.o_proj, a, stream)
        act = normed(mlp.gate_up_proj, stream, _fold(ss, layer.post_attention_layernorm), silu_mul=True)
        stream, ss = residual(mlp.down_proj, act, stream)
    return model.norm(stream)


def residual(linear: QuantLinear, x: torch.Tensor | DecodePartials, stream: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] (or a batch-1 decode's split partials), stream [1, N] -> (x @ W (+ bias) + stream, its sums of
    squares by 64 columns [1, N / 64] fp32): one kernel where the layer folds, else the twin."""
    folds = linear.packed is not None and kernel_folds(linear)
    if isinstance(x, DecodePartials):
        if folds and x.out.dtype == torch.float16 and x.o.shape[0] == 1 and x.features == linear.in_features:
            return w4a16_residual(x, linear.packed, stream, linear.bias)
        x = merge_partials(x).reshape(x.out.shape[0], -1)                  # [1, Hq D]
    if folds and x.is_cuda:
        return w4a16_residual(x, linear.packed, stream, linear.bias)
    return residual_ref(linear(x), stream)


def normed(linear: QuantLinear, stream: torch.Tensor, norm: FoldedNorm, silu_mul: bool = False) -> torch.Tensor:
    """RMSNorm(stream) * norm.weight @ W (+ bias), optionally its SwiGLU; norm holds the stream's sums of squares
    (residual's). One kernel where the layer folds, else the twin."""
    if linear.packed is not None and stream.is_cuda and kernel_folds(linear, silu_mul):
        return w4a16_normed(stream, linear.packed, norm, linear.bias, silu_mul)
    x = folded_norm_ref(stream, norm)
    return linear.forward_silu_mul(x) if silu_mul else linear(x)


def _fold(ss: torch.Tensor, norm) -> FoldedNorm:
    return FoldedNorm(ss, norm.weight, norm.eps)


def _observed(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)
