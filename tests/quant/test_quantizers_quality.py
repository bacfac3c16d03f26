"""tiny-qwen2 at g128: our AWQ and GPTQ beat RTN in perplexity and KL divergence on held-out val.txt windows.

Calibration is 32 documents of 256 tokens sampled from the FP16 model itself (`quant-serve make-calib
--samples-from`), never val.txt; 16 eval windows of 512 keep this fast. The full targets.md protocol (32,768 tokens)
is bench/quant_quality.py, whose figures are in bench/results/quant-quality-tiny-qwen2.json. Also: the plain-torch
forward the quantizers and the bench use matches the engine, and the bundled demo model (our AWQ) beats RTN too.
The quality comparisons need tiny-qwen2's own FP16 weights (../shared): the demo model's are on an INT4 grid already.
"""
import pytest
import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from helpers import bench_script, make_engine
from quant_serve.engine.load.loader import load_model_config
from quant_serve.engine.models.dense_calib import dense_logits
from quant_serve.engine.calib_samples import model_samples
from quant_serve.quant.awq import AWQSettings
from quant_serve.quant.calib import calib_tokens
from quant_serve.quant.gptq import GPTQSettings
from quant_serve.quant.quantize import QuantizeConfig, quantize_model
from quant_serve.server.cli.quantize import load_source

quant_quality = bench_script("quant_quality")
WINDOWS = 16
CONFIGS = {
    "rtn": QuantizeConfig(method="rtn", sym=False),
    "awq": QuantizeConfig(method="awq", awq=AWQSettings(search_tokens=2048)),
    "gptq": QuantizeConfig(method="gptq", sym=False, gptq=GPTQSettings(act_order=True)),
}


@pytest.fixture(scope="module")
def source(tiny_trained):
    return load_source(tiny_trained)


@pytest.fixture(scope="module")
def quality(source, tmp_path_factory, tiny_trained, val_txt):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_trained))
    docs = model_samples(str(tiny_trained), 32, 256, device="cpu")
    calib = calib_tokens(docs, lambda t: tok.encode(t, add_special_tokens=False), 32, 256,
                         [tok.convert_tokens_to_ids("<|endoftext|>")])
    windows = torch.tensor(tok.encode(val_txt.read_text(), add_special_tokens=False)[:WINDOWS * 512]).view(-1, 512)
    ref = quant_quality.reference_logprobs(source.model.config, quant_quality.dense_weights(tiny_trained), windows)
    out = {}
    for name, cfg in CONFIGS.items():
        path = quantize_model(source, calib, cfg, tmp_path_factory.mktemp("q") / name, show_progress=False)
        out[name] = quant_quality.compare(source.model.config, quant_quality.dense_weights(path), windows, ref)
    out["demo"] = quant_quality.compare(source.model.config, quant_quality.dense_weights(DEMO_MODEL_DIR), windows, ref)
    return out


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_quantizer_beats_rtn(quality, method):
    got, rtn = quality[method], quality["rtn"]
    assert got["perplexity"] < rtn["perplexity"], quality
    assert got["kld"] < rtn["kld"], quality
    assert got["kld"] < 0.05 and got["top1"] > 0.85, quality          # and close to the FP16 model at all


def test_demo_model_is_our_awq_and_beats_rtn(quality):
    import json
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["quantization_config"]["group_size"] == 128
    assert quality["demo"]["kld"] < quality["rtn"]["kld"], quality


def test_plain_forward_matches_the_engine(trained_model, heldout_text):
    engine = make_engine(trained_model, num_blocks=32, chunk=64, max_model_len=512)
    ids = torch.tensor(engine.tokenizer.encode(heldout_text)[:160])
    ours = dense_logits(load_model_config(trained_model)[0], quant_quality.dense_weights(trained_model), ids[None])[0]
    torch.testing.assert_close(ours, engine.score(ids.tolist()), rtol=1e-3, atol=1e-3)
