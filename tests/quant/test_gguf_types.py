"""GGUF tensor types -> internal layouts: bit-exact against gguf.quants.dequantize, and the K-quant writer's bytes
read back by gguf itself."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from quant_serve.kernels.matmul.reference import dequantize_w4
from quant_serve.kernels.matmul.reference_planes import dequantize_w8
from quant_serve.quant.formats.gguf.kquants import quantize
from quant_serve.quant.formats.gguf.types import (INT4_TYPES, int4_layout, path_of, read_dense, read_grouped,
                                                  w8_layout)

N, K = 24, 512


def _weight(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # rows with a mean far from 0 exercise the offsets; one all-zero row exercises d = 0
    w = rng.standard_normal((N, K)) * 0.02 + rng.standard_normal((N, 1)) * 0.02
    w[3] = 0.0
    return w.astype(np.float32)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K])
def test_reader_bit_exact(qtype):
    w = _weight()
    data = quantize(w, qtype)
    ref = torch.from_numpy(dequantize(data, qtype).reshape(N, K))
    g = read_grouped(data, qtype, N, K)
    if qtype in INT4_TYPES:
        assert path_of(qtype) == "int4" and int(g.codes.min()) >= 0 and int(g.codes.max()) <= 15
        qweight, scales, offsets = int4_layout(g)
        got = dequantize_w4(qweight, scales, None, g.group_size, offsets=offsets).t()
    else:
        assert path_of(qtype) == "w8"
        qweight, scales, offsets = w8_layout(g)
        got = dequantize_w8(qweight, scales, offsets, g.group_size).t()
    assert torch.equal(got, ref)
    # the writer is a quantizer, not a copy: its error is bounded by the format's step
    bound = {T.Q8_0: 0.002, T.Q6_K: 0.004, T.Q5_0: 0.006, T.Q5_1: 0.006, T.Q5_K: 0.006}.get(qtype, 0.012)
    assert float((ref - torch.from_numpy(w)).abs().max()) < bound
    assert torch.equal(read_dense(data, qtype, (N, K)), ref)


def test_dense_types():
    w = _weight()
    assert torch.equal(read_dense(w, T.F32, (N, K)), torch.from_numpy(w))
    assert torch.equal(read_dense(w.astype(np.float16), T.F16, (N, K)), torch.from_numpy(w).half())
    bf = quantize(w, T.BF16)
    assert torch.equal(read_dense(bf, T.BF16, (N, K)).float(), torch.from_numpy(dequantize(bf, T.BF16)))


def test_unsupported_type_and_bad_rows():
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        path_of(T.IQ2_XXS)
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 96), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="expected uint8 rows"):
        read_grouped(np.zeros((2, 10), np.uint8), T.Q4_0, 2, 32)


@pytest.mark.parametrize("model,checkpoint,want", [(torch.float16, torch.float32, torch.float16),
                                                   (torch.bfloat16, torch.float16, torch.float32),
                                                   (torch.bfloat16, torch.float32, torch.float32)])
def test_cuda_scale_dtype_never_narrows_to_bf16(model, checkpoint, want):
    """On CUDA a GGUF layer's scales go to fp16 on an fp16 model; a bf16 model (Gemma) keeps them in fp32: bf16's
    8 bits are coarser than Q8_0's steps (they were cast to the model dtype, bf16 too)."""
    from quant_serve.quant.layers.linear import gguf_kernel_scale_dtype
    from quant_serve.quant.layers.w8 import W8Linear
    assert gguf_kernel_scale_dtype(checkpoint, model) == want
    layer = W8Linear(64, [32], False, model, "cuda", None, 32)      # no tensor made: the choice alone
    assert layer._param_dtype(checkpoint) == want
