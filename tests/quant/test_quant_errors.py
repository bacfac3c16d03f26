"""Config discovery, per-module decisions and bad input: every error names the file or tensor at fault."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant_serve.quant.formats import (AWQConfig, CompressedTensorsConfig, GPTQConfig, awq_quantization_config,
                                       ct_quantization_config, gptq_quantization_config, load_quant_config,
                                       write_awq_gemm, write_gptq, write_pack_quantized)
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear, make_linear
from quant_serve.quant.rtn import quantize_rtn

L0 = "model.layers.0.mlp"


def checkpoint(tmp_path, quantization_config: dict | None, modules: dict[str, dict]):
    """Write config.json + model.safetensors; modules: prefix -> tensors."""
    flat = {f"{p}.{s}": t.contiguous() for p, ts in modules.items() for s, t in ts.items()}
    save_file(flat, str(tmp_path / "model.safetensors"))
    hf = {"model_type": "qwen2"} | ({"quantization_config": quantization_config} if quantization_config else {})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def load_like_the_engine(model_dir, k: int, sizes: list[int], prefixes: list[str], override=None):
    """What engine/load/loader.py does for one layer: header names -> config -> make_linear -> load_shard -> finalize."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    hf = json.loads((model_dir / "config.json").read_text())
    qc = load_quant_config(hf, model_dir, set(tensors), override)
    layer = make_linear(k, sizes, False, torch.float16, "cpu", qc, prefixes)
    for i, p in enumerate(prefixes):
        layer.load_shard(i, {n[len(p) + 1:]: t for n, t in tensors.items() if n.startswith(p + ".")}, p)
    layer.finalize()
    return layer


def awq_module(n=64, k=256, gs=128):
    q, s, z = quantize_rtn(torch.randn(n, k), 4, gs, sym=False)
    return write_awq_gemm(q, s, z, gs)


# ---- discovery -------------------------------------------------------------------------------------------

def test_discovery_locations(tmp_path):
    awq = awq_quantization_config(128)
    assert isinstance(load_quant_config({"quantization_config": awq}, None, set()), AWQConfig)
    assert isinstance(load_quant_config({"text_config": {"quantization_config": awq}}, None, set()), AWQConfig)
    ct = ct_quantization_config(64) | {"quant_method": "compressed_tensors"}
    found = load_quant_config({"compression_config": ct}, None, set())
    assert isinstance(found, CompressedTensorsConfig) and found.method == "compressed-tensors"
    assert found.group_size == 64
    assert load_quant_config({"model_type": "qwen2"}, tmp_path, set()) is None
    assert load_quant_config({}, tmp_path, set(), "none") is None


def test_old_autoawq_quant_config_json(tmp_path):
    (tmp_path / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}))
    qc = load_quant_config({}, tmp_path, set())
    assert isinstance(qc, AWQConfig) and qc.group_size == 64 and qc.version == "gemm"
    assert qc.describe() == "awq gemm, 4-bit, group 64, zero point"


def test_quantize_config_json(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps(
        {"bits": 4, "group_size": 32, "desc_act": True, "sym": False, "checkpoint_format": "gptq_v2"}))
    qc = load_quant_config({}, tmp_path, set())
    assert isinstance(qc, GPTQConfig) and qc.describe() == "gptq v2, 4-bit, group 32, zero point, act-order"
    assert GPTQConfig.from_dict({}, "x", None).describe() == "gptq v1, 4-bit, group 128, symmetric"


def test_unknown_method_and_overrides():
    with pytest.raises(ValueError, match=r"'fp8'.*supported: awq, gptq, compressed-tensors"):
        load_quant_config({"quantization_config": {"quant_method": "fp8"}}, None, set())
    awq = {"quantization_config": awq_quantization_config()}
    assert load_quant_config(awq, None, set(), "awq") is not None
    assert load_quant_config(awq, None, set(), "AWQ_Marlin") is not None
    with pytest.raises(ValueError, match="--quantization gptq disagrees.*awq"):
        load_quant_config(awq, None, set(), "gptq")
    with pytest.raises(ValueError, match="--quantization none disagrees"):
        load_quant_config(awq, None, set(), "none")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quant_config({}, None, set(), "compressed-tensors")


@pytest.mark.parametrize("raw, match", [
    (awq_quantization_config() | {"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    (awq_quantization_config() | {"version": None, "format": "gemv_fast"}, "'gemv_fast'"),
    (awq_quantization_config() | {"zero_point": False}, "zero_point=false"),
    (gptq_quantization_config() | {"checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "is_marlin_format": True}, "'marlin'"),
    (gptq_quantization_config() | {"bits": 3}, "3 bits"),
    (ct_quantization_config() | {"format": "float-quantized"} | {"config_groups": {"g": {"targets": ["Linear"]}}},
     "format 'float-quantized'"),
])
def test_unsupported_configs(raw, match):
    with pytest.raises(ValueError, match=match):
        load_quant_config({"quantization_config": raw}, None, set())


# ---- per-module decisions --------------------------------------------------------------------------------

def names(prefixes, suffixes):
    return {f"{p}.{s}" for p in prefixes for s in suffixes}


def test_per_module_decisions():
    awq_names = names([f"{L0}.gate_proj", f"{L0}.up_proj"], ["qweight", "qzeros", "scales"])
    qc = load_quant_config({"quantization_config": awq_quantization_config(128, ["up_proj"])}, None, awq_names)
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.qweight is in the checkpoint.*modules_to_not_convert"):
        qc.make_linear(256, [64, 64], False, torch.float16, "cpu", [f"{L0}.gate_proj", f"{L0}.up_proj"])
    # Header says dense (the quantizer left it in fp16): DenseLinear, like vLLM.
    qc = load_quant_config({"quantization_config": awq_quantization_config()}, None,
                           awq_names | {f"{L0}.down_proj.weight"})
    assert isinstance(qc.make_linear(64, [256], False, torch.float16, "cpu", [f"{L0}.down_proj"]), DenseLinear)
    with pytest.raises(ValueError, match="mixes quantized and unquantized"):
        qc.make_linear(256, [64, 256], False, torch.float16, "cpu", [f"{L0}.gate_proj", f"{L0}.down_proj"])
    with pytest.raises(ValueError, match=rf"{L0}.o_proj.qweight is missing from the checkpoint"):
        qc.make_linear(64, [64], False, torch.float16, "cpu", [f"{L0}.o_proj"])
    assert isinstance(qc.make_linear(64, [64], False, torch.float16, "cpu", ["lm_head"]), DenseLinear)
    with pytest.raises(ValueError, match="source_prefixes"):
        make_linear(64, [64], False, torch.float16, "cpu", qc)


def test_ct_ignore_regex_and_gptq_dynamic():
    ct = ct_quantization_config(128, ignore=["lm_head", "re:.*down_proj$"])
    qc = load_quant_config({"quantization_config": ct}, None,
                           names([f"{L0}.up_proj"], ["weight_packed", "weight_scale"]) | {f"{L0}.down_proj.weight"})
    assert isinstance(qc.make_linear(256, [64], False, torch.float16, "cpu", [f"{L0}.up_proj"]), QuantLinear)
    assert isinstance(qc.make_linear(64, [256], False, torch.float16, "cpu", [f"{L0}.down_proj"]), DenseLinear)
    gptq = gptq_quantization_config(128) | {"dynamic": {r"-:.*\.0\.mlp\.down_proj": {},
                                                        r"+:.*up_proj": {"group_size": 32}}}
    qc = load_quant_config({"quantization_config": gptq}, None,
                           names([f"{L0}.up_proj"], ["qweight", "scales", "qzeros"]) | {f"{L0}.down_proj.weight"})
    assert isinstance(qc.make_linear(64, [256], False, torch.float16, "cpu", [f"{L0}.down_proj"]), DenseLinear)
    assert qc.make_linear(256, [64], False, torch.float16, "cpu", [f"{L0}.up_proj"]).group_size == 32


# ---- bad files -------------------------------------------------------------------------------------------

def test_awq_file_missing_tensor(tmp_path):
    module = awq_module()
    del module["scales"]
    model_dir = checkpoint(tmp_path, awq_quantization_config(), {f"{L0}.up_proj": module})
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.scales is missing from the checkpoint"):
        load_like_the_engine(model_dir, 256, [64], [f"{L0}.up_proj"])


def test_wrong_group_size(tmp_path):
    model_dir = checkpoint(tmp_path, awq_quantization_config(64), {f"{L0}.up_proj": awq_module(gs=128)})
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.scales has 2 groups, expected 4 for group_size 64"):
        load_like_the_engine(model_dir, 256, [64], [f"{L0}.up_proj"])


def test_gemv_layout_awq_file(tmp_path):
    n, k, gs = 64, 256, 128
    w = -(-k // gs // 8)
    gemv = {"qweight": torch.zeros(n, k // 8, dtype=torch.int32), "qzeros": torch.zeros(n, w, dtype=torch.int32),
            "scales": torch.ones(n, 8 * w, dtype=torch.float16)}
    model_dir = checkpoint(tmp_path, awq_quantization_config(gs), {f"{L0}.up_proj": gemv})
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.qweight has shape \(64, 32\).*'gemv' layout"):
        load_like_the_engine(model_dir, k, [n], [f"{L0}.up_proj"])


def test_bad_shapes_and_g_idx(tmp_path):
    q, s, _ = quantize_rtn(torch.randn(64, 256), 4, 64, sym=True)
    bad_gidx = write_gptq(q, s, None, 64, g_idx=torch.arange(256) % 4)       # a permutation would be fine ...
    bad_gidx["g_idx"][:5] = 0                                                 # ... uneven groups are not
    model_dir = checkpoint(tmp_path, gptq_quantization_config(64, desc_act=True), {f"{L0}.up_proj": bad_gidx})
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.g_idx is not a valid act-order map"):
        load_like_the_engine(model_dir, 256, [64], [f"{L0}.up_proj"])
    ct = write_pack_quantized(q, s, None, 64)
    ct["weight_shape"] = torch.tensor([64, 248])
    model_dir = checkpoint(tmp_path, ct_quantization_config(64), {f"{L0}.up_proj": ct})
    with pytest.raises(ValueError, match=rf"{L0}.up_proj.weight_shape is \[64, 248\], expected \[64, 256\]"):
        load_like_the_engine(model_dir, 256, [64], [f"{L0}.up_proj"])


def test_engine_path_loads_a_merged_layer(tmp_path):
    mods = {f"{L0}.gate_proj": awq_module(), f"{L0}.up_proj": awq_module()}
    model_dir = checkpoint(tmp_path, awq_quantization_config(), mods)
    layer = load_like_the_engine(model_dir, 256, [64, 64], list(mods), override="awq")
    assert isinstance(layer, QuantLinear) and layer.qweight.shape == (32, 128) and layer.scales.shape == (2, 128)
    assert layer(torch.randn(3, 256, dtype=torch.float16)).shape == (3, 128)
    with pytest.raises(ValueError, match="never received tensors for .*up_proj"):
        qc = load_quant_config(json.loads((model_dir / "config.json").read_text()), model_dir,
                               names(list(mods), ["qweight", "qzeros", "scales"]))
        partial = qc.make_linear(256, [64, 64], False, torch.float16, "cpu", list(mods))
        partial.load_shard(0, mods[f"{L0}.gate_proj"], f"{L0}.gate_proj")
        partial.finalize()
