"""`quant-serve quantize --kv-scales` stores calibrated FP8 KV scales next to the weights; an fp8 engine uses them."""
import json
import logging

import pytest

from helpers import make_engine
from quant_serve.server.cli.main import main

CALIB = "\n\n".join(
    f"The {name} module provides tools for working with {name} data. Call {name}.open() to begin, "
    f"then read records one by one; errors raise {name.capitalize()}Error." for name in
    ("csv", "json", "zipfile", "tarfile", "sqlite3", "shelve", "pickle", "struct", "array", "queue"))


def test_quantize_with_kv_scales_then_serve_fp8(tmp_path, caplog, random_model):
    layers = json.loads((random_model / "config.json").read_text())["num_hidden_layers"]
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "rtn"
    assert main(["quantize", str(random_model), str(out), "--method", "rtn", "--kv-scales", "--calib", str(calib),
                 "--calib-samples", "4", "--calib-seq-len", "64", "--device", "cpu"]) == 0
    data = json.loads((out / "kv_scales.json").read_text())
    assert data["format"] == "quant-serve-kv-scales" and len(data["layers"]) == layers
    for layer in data["layers"].values():   # scale = amax * margin / e4m3 max
        assert layer["k_scale"] == pytest.approx(layer["k_amax"] * data["margin"] / 448.0)
        assert 0 < layer["k_amax"] < 448 and 0 < layer["v_amax"] < 448
    with caplog.at_level(logging.INFO, logger="quant_serve"):
        engine = make_engine(out, kv_cache_dtype="fp8")
    assert "K/V scales from" in caplog.text and "kv_scales.json" in caplog.text
    got = [float(a.k_scale) for a in engine.model.attention_layers]
    assert got == pytest.approx([data["layers"][str(i)]["k_scale"] for i in range(layers)])


def test_kv_scales_without_calib_sample_the_model(tmp_path, caplog, random_model):
    with caplog.at_level(logging.INFO, logger="quant_serve"):
        assert main(["quantize", str(random_model), str(tmp_path / "x"), "--method", "rtn", "--kv-scales",
                     "--calib-samples", "2", "--calib-seq-len", "32", "--device", "cpu"]) == 0
    assert "calibration: 2 sequences x 32 tokens sampled from the model (seed 0)" in caplog.text
    layers = json.loads((random_model / "config.json").read_text())["num_hidden_layers"]
    assert len(json.loads((tmp_path / "x" / "kv_scales.json").read_text())["layers"]) == layers
