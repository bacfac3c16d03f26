"""tiny-qwen2 at g128: our AWQ and GPTQ beat RTN in perplexity and KL divergence on held-out val.txt windows.

Calibration is 32 documents of 256 tokens sampled from the FP16 model itself (`quant-serve make-calib
--samples-from`), never val.txt; 16 eval windows of 512 keep this fast. The full targets.md protocol (32,768 tokens)
is bench/quant_quality.py, whose figures are in bench/results/quant-quality-tiny-qwen2.json. Also: the plain-torch
forward the quantizers and the bench use matches the engine, and the bundled demo model (our AWQ) beats RTN too.
"""
import importlib.util

import pytest
import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from helpers import make_engine
from quant_serve.quant.awq import AWQSettings
from quant_serve.engine.models.dense_calib import dense_logits
from quant_serve.quant.calib import calib_tokens
from quant_serve.quant.gptq import GPTQSettings
from quant_serve.quant.quantize import QuantizeConfig, quantize_model
from quant_serve.server.cli.calib import model_samples
from quant_serve.server.cli.quantize import load_source

from conftest import REPO, TINY


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quant_quality = _bench("quant_quality")
WINDOWS = 16
CONFIGS = {
    "rtn": QuantizeConfig(method="rtn", sym=False),
    "awq": QuantizeConfig(method="awq", awq=AWQSettings(search_tokens=2048)),
    "gptq": QuantizeConfig(method="gptq", sym=False, gptq=GPTQSettings(act_order=True)),
}


@pytest.fixture(scope="session")
def source():
    return load_source(TINY)


@pytest.fixture(scope="session")
def quality(source, tmp_path_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TINY))
    docs = model_samples(str(TINY), 32, 256, device="cpu")
    calib = calib_tokens(docs, lambda t: tok.encode(t, add_special_tokens=False), 32, 256,
                         [tok.convert_tokens_to_ids("<|endoftext|>")])
    windows = quant_quality.val_windows(TINY, WINDOWS * 512)
    ref = quant_quality.reference_logprobs(source.model.config, quant_quality.dense_weights(TINY), windows)
    out = {}
    for name, cfg in CONFIGS.items():
        path = quantize_model(source, calib, cfg, tmp_path_factory.mktemp("q") / name, show_progress=False)
        out[name] = quant_quality.compare(source.model.config, quant_quality.dense_weights(path), windows, ref)
    if (DEMO_MODEL_DIR / "config.json").is_file():
        out["demo"] = quant_quality.compare(source.model.config, quant_quality.dense_weights(DEMO_MODEL_DIR), windows,
                                            ref)
    return out


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_quantizer_beats_rtn(quality, method):
    got, rtn = quality[method], quality["rtn"]
    assert got["perplexity"] < rtn["perplexity"], quality
    assert got["kld"] < rtn["kld"], quality
    assert got["kld"] < 0.05 and got["top1"] > 0.85, quality          # and close to the FP16 model at all


def test_demo_model_is_our_awq_and_beats_rtn(quality):
    if "demo" not in quality:
        pytest.skip("engine/load/demo_model is not installed")
    import json
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["quantization_config"]["group_size"] == 128
    assert quality["demo"]["kld"] < quality["rtn"]["kld"], quality


def test_plain_forward_matches_the_engine(source):
    ids = quant_quality.val_windows(TINY, 512)[0, :160]
    ours = dense_logits(source.model.config, quant_quality.dense_weights(TINY), ids[None])[0]
    engine = make_engine(TINY, num_blocks=32, chunk=64, max_model_len=512).score(ids.tolist())
    torch.testing.assert_close(ours, engine, rtol=1e-3, atol=1e-3)
