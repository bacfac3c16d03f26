"""Calibration without a file: `quant-serve quantize --method awq|gptq` samples its calibration text from the model
itself (engine/calib_samples.py; deterministic per --calib-seed; fewer, shorter windows on the CPU) and says so
before it starts; `quant-serve make-calib` (shipped with the package, no longer only bench/make_calib.py) writes the
README's calibration file from docstrings, WordNet and model samples."""
import json
import logging

import pytest
import torch

from quant_serve.engine.calib_samples import CalibWindows, default_windows, sample_token_windows
from quant_serve.quant.awq import AWQSettings, default_search_tokens
from quant_serve.quant.calib import read_calib_file
from quant_serve.quant.calib_data import wordnet_entries
from quant_serve.server.cli import quantize as cli_quantize
from quant_serve.server.cli.main import main as cli

# The WordNet 3.0 data-file format (lemma at field 4, part of speech at field 2, gloss after " | ").
WORDNET_LINES = {
    "noun": "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived to have its own existence",
    "verb": "00001740 29 v 04 breathe 0 take_a_breath 0 002 * 00005041 v 0000 | draw air into, and expel out of",
    "adj": "00001740 00 a 01 able(a) 0 005 = 05207437 n 0000 | (usually followed by `to') having the necessary means",
    "adv": "00001740 02 r 01 barely 0 003 \\ 01818029 a 0101 | by a little; \"we barely made it\"",
}


def test_quantize_without_calib_samples_from_the_model(tmp_path, caplog, monkeypatch, random_model):
    log_at_sampling = []

    def sample(*args, **kwargs):
        log_at_sampling.append(caplog.text)
        return sample_token_windows(*args, **kwargs)

    monkeypatch.setattr(cli_quantize, "sample_token_windows", sample)
    out = tmp_path / "gptq"
    with caplog.at_level(logging.INFO, logger="quant_serve"):
        assert cli(["quantize", str(random_model), str(out), "--method", "gptq", "--calib-samples", "2",
                    "--calib-seq-len", "32", "--device", "cpu"]) == 0
    # said before the sampling starts, which is the slow part on a CPU
    assert len(log_at_sampling) == 1
    assert ("calibration: 2 sequences x 32 tokens sampled from the model (seed 0); pass --calib FILE for your own "
            "data") in log_at_sampling[0]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert cli(["generate", "--model", str(out), "--prompt", "The Python", "--max-tokens", "4"]) == 0


def test_sampled_windows_are_deterministic(random_model):
    a, tok = sample_token_windows(random_model, 3, 24, seed=5, device="cpu", show_progress=False)
    b, _ = sample_token_windows(random_model, 2, 24, seed=5, device="cpu", show_progress=False)
    c, _ = sample_token_windows(random_model, 2, 24, seed=6, device="cpu", show_progress=False)
    assert a.shape == (3, 24) and a.dtype == torch.int64
    assert a[:, 0].tolist() == [tok.convert_tokens_to_ids("<|endoftext|>")] * 3   # Qwen: no BOS, the separator
    assert torch.equal(a[:2], b)                              # a window depends on its seed, not on the batch
    assert not torch.equal(a[:2], c)
    assert len({tuple(w.tolist()) for w in a}) == 3


def test_sampling_progress_counts_tokens(capsys, random_model):
    sample_token_windows(random_model, 2, 24, device="cpu", show_progress=True)
    err = capsys.readouterr().err
    assert "Sampling calibration: 100%" in err and "46/46" in err and "tok/s" in err     # 2 x 23 sampled tokens


def test_shorter_windows_are_prefixes(random_model):
    long, _ = sample_token_windows(random_model, 3, 40, seed=2, device="cpu", show_progress=False)
    short, _ = sample_token_windows(random_model, 2, 17, seed=2, device="cpu", show_progress=False)
    assert torch.equal(long[:2, :17], short)                   # bench/default_calib.py compares sizes on this


class Sampled(Exception):
    """Stops `quant-serve quantize` once it asked for its calibration windows."""


def test_default_windows_by_device(tmp_path, monkeypatch, random_model):
    assert default_windows("cpu") == CalibWindows(64, 128)     # bench/results/default-calib-cpu-tiny-qwen2.json
    assert default_windows("cuda") == default_windows("cuda:1") == CalibWindows(128, 512)
    asked = []

    def sample(model_dir, count, length, seed, device):
        asked.append((count, length))
        raise Sampled

    monkeypatch.setattr(cli_quantize, "sample_token_windows", sample)
    for flags in ([], ["--calib-samples", "3"], ["--calib-seq-len", "48"]):
        with pytest.raises(Sampled):
            cli(["quantize", str(random_model), str(tmp_path / "q"), "--method", "awq", "--device", "cpu", *flags])
    assert asked == [(64, 128), (3, 128), (64, 48)]


def test_awq_search_tokens_by_device(tmp_path, monkeypatch, random_model):
    assert default_search_tokens("cpu") == 2048 and default_search_tokens("cuda") == AWQSettings().search_tokens
    searched = []

    def quantize(source, calib, cfg, out_dir, **kwargs):
        searched.append(cfg.awq.search_tokens)
        raise Sampled

    monkeypatch.setattr(cli_quantize, "sample_token_windows", lambda *args: (torch.zeros(2, 16, dtype=torch.int64),
                                                                             None))
    monkeypatch.setattr(cli_quantize, "quantize_model", quantize)
    for flags in ([], ["--awq-search-tokens", "4096"]):
        with pytest.raises(Sampled):
            cli(["quantize", str(random_model), str(tmp_path / "q"), "--method", "awq", "--device", "cpu", *flags])
    assert searched == [2048, 4096]


def test_make_calib_is_a_subcommand(tmp_path, capsys, random_model):
    wordnet = tmp_path / "wordnet"
    wordnet.mkdir()
    for part, line in WORDNET_LINES.items():
        (wordnet / f"data.{part}").write_text("  1 This software and database is being provided\n" + line + "\n",
                                              encoding="latin-1")
    out = tmp_path / "calib.jsonl"
    assert cli(["make-calib", str(out), "--docstrings", "--max-docs", "5", "--wordnet", str(wordnet),
                "--chat-model", str(random_model), "--chat-share", "0.5", "--samples-from", str(random_model),
                "--samples", "2",
                "--sample-len", "16", "--device", "cpu"]) == 0
    assert "wrote 11 documents" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "stdlib docstrings" in rows[0]["source"]
    assert "4 WordNet 3.0 entries (wordnet), 50% as chat turns" in rows[0]["source"]
    assert f"2 samples of 16 tokens from {random_model.name}" in rows[0]["source"]
    docs = read_calib_file(out)
    assert len(docs) == 11 and docs[0].startswith("abc")       # 5 docstrings, 2 samples, 4 glosses
    chat_turns = [d for d in docs[7:] if d.startswith('<|im_start|>user\nWhat does "')]
    assert len(chat_turns) == 2                                 # the seeded draw: 0.13, 0.85, 0.76, 0.26 < 0.5
    assert sorted(w for w, _ in wordnet_entries(wordnet, 10)) == ["able", "barely", "breathe", "entity"]
    assert ("Able (a): (usually followed by `to') having the necessary means."
            in dict(wordnet_entries(wordnet, 10)).values())
    rtn = tmp_path / "rtn"
    assert cli(["quantize", str(random_model), str(rtn), "--method", "rtn", "--kv-scales", "--calib", str(out),
                "--calib-samples", "2", "--calib-seq-len", "64", "--device", "cpu"]) == 0
    assert (rtn / "kv_scales.json").is_file()


def test_make_calib_errors(tmp_path, capsys, random_model):
    assert cli(["make-calib", str(tmp_path / "x.jsonl"), "--wordnet", str(tmp_path / "nope")]) == 2
    assert "WordNet" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    with pytest.raises(ValueError, match="at least one window"):
        sample_token_windows(random_model, 0, 16, device="cpu")
