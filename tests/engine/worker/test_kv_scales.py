"""FP8 KV cache scales: calibration file, first-prompt rule, checkpoint names, overflow detection, accuracy."""
import json
import logging
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant_serve.engine.worker.kv_calibration import calibrate_kv_scales
from quant_serve.engine.worker.kv_scales import (E4M3_MAX, KV_SCALE_MARGIN, parse_kv_scale_name,
                                                 read_kv_scales, resolve_kv_scales, scale_from_amax, write_kv_scales)
from helpers import assert_all_blocks_free, make_engine

WINDOW, NUM_WINDOWS = 512, 4       # the eval windows: the first 2,048 tokens of the held-out text


def linked_copy(model, path):
    """The model in a writable directory (files are symlinks), so kv_scales.json can be written beside it."""
    path.mkdir(exist_ok=True)
    for f in model.iterdir():
        (path / f.name).symlink_to(f)
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, text_ids, trained_model):
    """(model dir with kv_scales.json calibrated on other text than the eval windows, fp16-KV logits per window)"""
    model_dir = linked_copy(trained_model, tmp_path_factory.mktemp("calibrated") / "model")
    engine = make_engine(model_dir, kv_cache_dtype="fp16", chunk=WINDOW)
    start = NUM_WINDOWS * WINDOW
    calibration = [text_ids[start + i * WINDOW: start + (i + 1) * WINDOW] for i in range(4)]
    scales = calibrate_kv_scales(engine, calibration)
    assert scales["num_tokens"] == 4 * WINDOW
    write_kv_scales(model_dir, scales)
    assert_all_blocks_free(engine)
    return model_dir, [engine.score(w) for w in windows(text_ids)]


def windows(text_ids):
    return [text_ids[i * WINDOW:(i + 1) * WINDOW] for i in range(NUM_WINDOWS)]


def perplexity(logits: list[torch.Tensor], text_ids) -> float:
    nll = [torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(w[1:]), reduction="sum")
           for lg, w in zip(logits, windows(text_ids))]
    return math.exp(float(sum(nll)) / sum(len(w) - 1 for w in windows(text_ids)))


@pytest.mark.parametrize("kv_dtype, min_top1", [("fp8_e4m3", 0.96), ("fp8_e5m2", 0.94)])
def test_fp8_perplexity_with_calibrated_scales(calibrated, text_ids, kv_dtype, min_top1):
    model_dir, ref_logits = calibrated
    engine = make_engine(model_dir, kv_cache_dtype=kv_dtype, chunk=WINDOW)
    file_layers = read_kv_scales(model_dir, 8)["layers"]
    assert [float(a.k_scale) for a in engine.model.attention_layers] == \
        pytest.approx([file_layers[str(i)]["k_scale"] for i in range(8)])
    logits = [engine.score(w) for w in windows(text_ids)]
    ppl_ref, ppl = perplexity(ref_logits, text_ids), perplexity(logits, text_ids)
    top1 = float(torch.cat([(a[:-1].argmax(-1) == b[:-1].argmax(-1)) for a, b in zip(logits, ref_logits)]).float()
                 .mean())
    print(f"{kv_dtype}: ppl {ppl:.4f} vs fp16 KV {ppl_ref:.4f} ({(ppl / ppl_ref - 1) * 100:+.2f}%), "
          f"top-1 {top1 * 100:.1f}%")
    assert abs(ppl / ppl_ref - 1) < 0.01
    assert top1 >= min_top1


def test_first_prompt_rule_sets_scales_inside_the_first_forward(text_ids, caplog, trained_model):
    prompt = text_ids[4100:4200]
    fp16 = make_engine(trained_model, kv_cache_dtype="fp16")
    amax = calibrate_kv_scales(fp16, [prompt])["layers"]
    engine = make_engine(trained_model, kv_cache_dtype="fp8_e4m3", kv_scale_source="first-prompt")
    assert all(float(a.k_scale) == 1.0 for a in engine.model.attention_layers)
    with caplog.at_level(logging.INFO, logger="quant_serve"):
        engine.score(prompt)
    layers = engine.model.attention_layers
    # Layer 0 sees exactly the fp16 run's K/V; later layers read an fp8 cache already, so only nearly.
    assert float(layers[0].k_scale) == pytest.approx(amax["0"]["k_amax"] * KV_SCALE_MARGIN / E4M3_MAX, rel=1e-6)
    for i, attn in enumerate(layers):
        assert float(attn.k_scale) == pytest.approx(amax[str(i)]["k_scale"], rel=0.05)
        assert float(attn.v_scale) == pytest.approx(amax[str(i)]["v_scale"], rel=0.05)
    assert "scales from the first prompt (100 tokens)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # computed once: a later, different prompt leaves them alone
    before = [float(a.k_scale) for a in layers]
    engine.score(text_ids[4200:4500])
    assert [float(a.k_scale) for a in layers] == before


def _blow_up_k(engine, layer: int, factor: float) -> None:
    attn = engine.model.attention_layers[layer]
    q_size, kv_size = attn.split_sizes[:2]
    rows = slice(q_size, q_size + kv_size)
    attn.qkv_proj.weight.data[rows] *= factor
    attn.qkv_proj.bias.data[rows] *= factor


def test_unscaled_e4m3_with_large_activations_is_detected(text_ids, caplog, trained_model):
    prompt = text_ids[4300:4340]
    engine = make_engine(trained_model, kv_cache_dtype="fp8_e4m3", kv_scale_source="unit")
    _blow_up_k(engine, 2, 100.0)                     # |k| of layer 2 goes from ~13 to ~1300, past 448
    with caplog.at_level(logging.WARNING, logger="quant_serve"):
        engine.score(prompt)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("layer 2 |k| amax" in w and "exceeds the fp8 range at k_scale 1" in w for w in warnings), warnings
    assert not any("layer 1 " in w or "layer 3 " in w for w in warnings)
    amax = float(next(w for w in warnings if "layer 2 |k|" in w).split("amax ")[1].split()[0])
    assert amax > E4M3_MAX

    # The same model with scales from the first prompt: layer 2 gets a scale that fits, and no warning.
    caplog.clear()
    scaled = make_engine(trained_model, kv_cache_dtype="fp8_e4m3", kv_scale_source="first-prompt")
    _blow_up_k(scaled, 2, 100.0)
    with caplog.at_level(logging.WARNING, logger="quant_serve"):
        scaled.score(prompt)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # (layers 0 and 1 now store with other scales, so layer 2 sees nearly, not exactly, the same K)
    assert float(scaled.model.attention_layers[2].k_scale) == pytest.approx(amax * KV_SCALE_MARGIN / E4M3_MAX,
                                                                           rel=0.01)


CHECKPOINT_SCALES = {
    "model.layers.0.self_attn.k_scale": 0.11, "model.layers.0.self_attn.v_scale": 0.21,
    "model.layers.1.self_attn.k_proj.k_scale": 0.12, "model.layers.1.self_attn.v_proj.v_scale": 0.22,
    "model.layers.2.self_attn.qkv_proj.k_scale": 0.13, "model.layers.2.self_attn.qkv_proj.v_scale": 0.23,
    "model.layers.3.self_attn.kv_scale": 0.14,
    "model.layers.4.self_attn.k_proj.output_scale": 0.15, "model.layers.4.self_attn.v_proj.output_scale": 0.25,
    "model.layers.4.self_attn.q_proj.output_scale": 9.0,
    "model.layers.5.self_attn.attn.k_scale": 0.16, "model.layers.5.self_attn.attn.v_scale": 0.26,
    "model.layers.6.self_attn.k_scale": 0.17, "model.layers.6.self_attn.v_scale": 0.27,
    "model.layers.6.self_attn.q_scale": 5.0, "model.layers.6.self_attn.prob_scale": 5.0,
    "model.layers.7.self_attn.k_scale": 0.18, "model.layers.7.self_attn.v_scale": 0.28,
}


def test_checkpoint_scale_names_are_read(tmp_path, caplog, trained_model):
    model_dir = linked_copy(trained_model, tmp_path / "model")
    save_file({name: torch.tensor([value] if "layers.6" in name else value, dtype=torch.float32)
               for name, value in CHECKPOINT_SCALES.items()}, str(tmp_path / "kv-scales.safetensors"))
    (model_dir / "kv-scales.safetensors").symlink_to(tmp_path / "kv-scales.safetensors")
    with safe_open(str(trained_model / "model.safetensors"), "pt") as f:      # one file: an index adds the scales
        weight_map = {name: "model.safetensors" for name in f.keys()}
    weight_map.update({name: "kv-scales.safetensors" for name in CHECKPOINT_SCALES})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    with caplog.at_level(logging.INFO, logger="quant_serve"):
        engine = make_engine(model_dir, kv_cache_dtype="fp8_e4m3")
    assert "K/V scales from the checkpoint" in caplog.text and "ignoring unexpected tensor" not in caplog.text
    scales = [float(s) for a in engine.model.attention_layers for s in (a.k_scale, a.v_scale)]
    expected = [0.11, 0.21, 0.12, 0.22, 0.13, 0.23, 0.14, 0.14, 0.15, 0.25, 0.16, 0.26, 0.17, 0.27, 0.18, 0.28]
    assert scales == pytest.approx(expected)
    # The weights are untouched by the scale tensors: same logits as the plain fixture (fp16 KV: no fp8 rounding).
    ids = list(range(100, 140))
    torch.testing.assert_close(make_engine(model_dir, kv_cache_dtype="fp16").score(ids),
                               make_engine(trained_model, kv_cache_dtype="fp16").score(ids))
    # Without an fp8 cache the scales are not used (1.0).
    plain = make_engine(model_dir)
    assert all(float(a.k_scale) == 1.0 == float(a.v_scale) for a in plain.model.attention_layers)


@pytest.mark.parametrize("name, expected", [
    ("model.layers.12.self_attn.k_proj.k_scale", (12, ("k",))),
    ("model.layers.3.self_attn.kv_scale", (3, ("k", "v"))),
    ("model.layers.0.self_attn.v_proj.output_scale", (0, ("v",))),
    ("model.layers.0.self_attn.q_proj.output_scale", (0, ())),
    ("model.layers.0.self_attn.prob_scale", (0, ())),
    ("model.layers.0.self_attn.k_proj.weight", None),
    ("model.layers.0.self_attn.k_proj.weight_scale", None),
    ("model.layers.0.mlp.down_proj.output_scale", None),
    ("lm_head.k_scale", None),
])
def test_parse_kv_scale_name(name, expected):
    assert parse_kv_scale_name(name) == expected


def _flat(pairs):
    """pytest.approx compares flat sequences only (pytest >= 9.2 rejects nested ones)."""
    return [x for pair in pairs for x in pair]


def test_scale_sources_and_file_format(tmp_path, caplog):
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    k_amax, v_amax = [10.0, 20.0], [4.0, 8.0]
    from quant_serve.engine.worker.kv_scales import make_kv_scales
    data = make_kv_scales(k_amax, v_amax, 64, dtype_max=57344.0)
    assert data["layers"]["1"]["k_scale"] == scale_from_amax(20.0, 57344.0)
    write_kv_scales(tmp_path, data)
    assert read_kv_scales(tmp_path, 2) == data
    # made for e5m2's range: an e4m3 cache scales them up by 57344 / 448 so the values still fit
    assert _flat(resolve_kv_scales("file", e4m3, tmp_path, {}, 2)) == pytest.approx(
        _flat([(10 * 2 / 448, 4 * 2 / 448), (20 * 2 / 448, 8 * 2 / 448)]))
    assert _flat(resolve_kv_scales("auto", e5m2, tmp_path, {}, 2)) == pytest.approx(
        _flat([(10 * 2 / 57344, 4 * 2 / 57344), (20 * 2 / 57344, 8 * 2 / 57344)]))
    # checkpoint scales win in auto; partial ones are not used (warned), the file is
    ckpt = {0: {"k_scale": 0.5, "v_scale": 0.25}, 1: {"k_scale": 0.125, "v_scale": 0.0625}}
    assert resolve_kv_scales("auto", e4m3, tmp_path, ckpt, 2) == [(0.5, 0.25), (0.125, 0.0625)]
    with caplog.at_level(logging.WARNING, logger="quant_serve"):
        assert _flat(resolve_kv_scales("auto", e4m3, tmp_path, {0: ckpt[0]}, 2)) == pytest.approx(
            _flat([(10 * 2 / 448, 4 * 2 / 448), (20 * 2 / 448, 8 * 2 / 448)]))
    assert "K and V scales for 1 of 2 layers ([0])" in caplog.text
    with pytest.raises(ValueError, match="checkpoint: the checkpoint has K and V scales for 1 of 2 layers"):
        resolve_kv_scales("checkpoint", e4m3, tmp_path, {0: ckpt[0]}, 2)
    with pytest.raises(ValueError, match="the model has 3"):
        resolve_kv_scales("file", e4m3, tmp_path, {}, 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve_kv_scales("auto", e4m3, empty, {}, 2) is None          # first prompt
    with pytest.raises(ValueError, match="no kv_scales.json in"):
        resolve_kv_scales("file", e4m3, empty, {}, 2)
    with pytest.raises(ValueError, match="unknown kv scale source 'bogus'"):
        resolve_kv_scales("bogus", e4m3, empty, {}, 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quant_serve"):
        assert resolve_kv_scales("unit", e4m3, tmp_path, ckpt, 2) == [(1.0, 1.0)] * 2
    assert "forced to 1.0" in caplog.text
    assert resolve_kv_scales("auto", torch.float16, tmp_path, ckpt, 2) == [(1.0, 1.0)] * 2
    for bad, message in [({**data, "format": "x"}, "not a quant-serve-kv-scales file"),
                         ({**data, "version": 2}, "version 2 is not supported"),
                         ({**data, "layers": {"0": {"k_scale": -1.0, "v_scale": 1.0}}}, "layer 0 k_scale must be")]:
        (tmp_path / "kv_scales.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            read_kv_scales(tmp_path, 1)


def test_calibration_ignores_the_engines_own_cache(text_ids, trained_model):
    fp8 = make_engine(trained_model, kv_cache_dtype="fp8_e4m3", kv_scale_source="unit")
    caches = [(a.k_cache, a.v_cache) for a in fp8.model.attention_layers]
    batches = [[text_ids[100:160], text_ids[300:333]], text_ids[500:580]]
    from_fp8_engine = calibrate_kv_scales(fp8, batches)
    # a bare model with other weights-identical engine: same K/V, so the same figures, whatever the cache dtype
    from_model = calibrate_kv_scales(make_engine(trained_model, num_blocks=130).model, batches)
    assert from_model == from_fp8_engine and from_model["num_tokens"] == 60 + 33 + 80
    assert all(a.k_cache is k and a.v_cache is v for a, (k, v) in zip(fp8.model.attention_layers, caches))
    assert all(float(a.k_scale) == 1.0 for a in fp8.model.attention_layers)
    assert fp8.runner.num_tokens_forwarded == 0 and fp8.block_manager.cached == {}
    assert_all_blocks_free(fp8)
