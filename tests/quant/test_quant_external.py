"""Our writers and readers against the original tools' own code, when installed: compressed-tensors'
PackedQuantizationCompressor and AutoAWQ's packing_utils (loaded by file: importing the awq package itself pulls in
accelerate and CUDA kernels). Each test skips with a reason when its package is missing."""
import importlib.util
from pathlib import Path

import pytest
import torch

from quant_serve.quant.formats import (awq_quantization_config, ct_quantization_config, load_quant_config,
                                       write_awq_gemm, write_gptq, write_pack_quantized)
from quant_serve.quant.rtn import dequantize_codes, quantize_rtn

PREFIX = "model.layers.0.mlp.up_proj"


def read(cfg, tensors, k):
    qc = load_quant_config({"quantization_config": cfg}, None, {f"{PREFIX}.{s}" for s in tensors})
    n = tensors["scales"].shape[1] if "scales" in tensors else tensors["weight_scale"].shape[0]
    layer = qc.make_linear(k, [n], False, torch.float32, "cpu", [PREFIX])
    layer.load_shard(0, tensors, PREFIX)
    layer.finalize()
    return layer


def awq_packing_utils():
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("autoawq is not installed (pip install --no-deps autoawq)")
    path = Path(list(spec.submodule_search_locations)[0]) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def ct_scheme(gs, sym):
    qz = pytest.importorskip("compressed_tensors.quantization", reason="compressed-tensors is not installed")
    args = qz.QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group" if gs > 0 else "channel",
                               group_size=gs if gs > 0 else None)
    return qz.QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("gs", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compressed_tensors_decompresses_our_writer(sym, gs, dtype):
    scheme = ct_scheme(gs, sym)
    from compressed_tensors.compressors import PackedQuantizationCompressor
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(gs + sym)) * 0.05
    q, s, z = quantize_rtn(w, 4, gs, sym)
    ours = write_pack_quantized(q, s, z, gs, scale_dtype=dtype)
    theirs = PackedQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    assert theirs.dtype == dtype
    expected = dequantize_codes(q, ours["weight_scale"].t().float(), z, gs)
    assert torch.equal(theirs, expected.to(dtype))
    assert torch.equal(read(ct_quantization_config(gs, sym), ours, 256).dequantized_weight().to(dtype), theirs)


@pytest.mark.parametrize("sym", [True, False])
def test_our_reader_on_compressed_tensors_compress(sym):
    scheme = ct_scheme(64, sym)
    from compressed_tensors.compressors import PackedQuantizationCompressor
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16) * 0.05
    q, s, z = quantize_rtn(w.float(), 4, 64, sym)
    state = {"weight": w, "weight_scale": s.t().to(torch.bfloat16)}
    if not sym:
        state["weight_zero_point"] = (z.t() - 8).to(torch.int8)                   # ct zero points are signed
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert packed["weight_packed"].dtype == torch.int32 and "weight" not in packed
    assert ("weight_zero_point" in packed) == (not sym)
    theirs = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    ours = read(ct_quantization_config(64, sym), packed, 128).dequantized_weight()
    assert torch.equal(ours.to(torch.bfloat16), theirs)


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_autoawq_dequantizes_our_writer(gs):
    utils = awq_packing_utils()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(gs)) * 0.05
    q, s, z = quantize_rtn(w, 4, gs, sym=False)
    ours = write_awq_gemm(q, s, z, gs)
    theirs = utils.dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"], 4, gs)    # [K, N] fp16
    expected = dequantize_codes(q, ours["scales"].float(), z, gs)
    assert torch.equal(theirs.t(), expected.half())
    assert torch.equal(read(awq_quantization_config(gs), ours, 256).dequantized_weight().half(), theirs.t())


def test_autoawq_awq_to_exllama_equals_our_gptq_v1_writer():
    """AutoAWQ's own AWQ -> exllama (GPTQ v1) repack of symmetric codes is bit-identical to our GPTQ v1 writer."""
    utils = awq_packing_utils()
    q, s, _ = quantize_rtn(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), 4, 128, sym=True)
    awq = write_awq_gemm(q, s, None, 128)
    qweight, qzeros = utils.unpack_reorder_pack(awq["qweight"], awq["qzeros"], 4)
    gptq = write_gptq(q, s, None, 128)
    assert torch.equal(qweight, gptq["qweight"]) and torch.equal(qzeros, gptq["qzeros"])
