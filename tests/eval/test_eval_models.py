"""quant-serve eval on the fixture models, checked against computations that share none of the harness's code:
transformers (fp32) on the FP16 model and on INT4 weights dequantized here from the checkpoints' own formulas.

One CLI run (2,048 tokens, 4 items per task) covers: FP16 vs itself, the AutoAWQ and llm-compressor fixtures, and a
damaged copy of the AWQ model (one layer's scales x4), which must fail the default gate. All of it needs ../shared:
tiny-qwen2 as trained, its held-out text and the third parties' checkpoints.
"""
import glob
import json
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quant_serve.server.cli.main import main

MAX_TOKENS, CONTEXT = 2048, 512
DAMAGED = "model.layers.5.mlp.down_proj"
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]      # column j of each group of 8 sits in nibble AWQ_REVERSE[j]
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def damaged_dir(tmp_path_factory, tiny_awq_autoawq):
    out = tmp_path_factory.mktemp("models") / "tiny-qwen2-awq-damaged"
    shutil.copytree(tiny_awq_autoawq, out)
    tensors = load_file(out / "model.safetensors")
    tensors[f"{DAMAGED}.scales"] = tensors[f"{DAMAGED}.scales"] * 4
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, damaged_dir, tiny_trained, tiny_awq_autoawq, tiny_ct, val_txt):
    """The CLI once over all candidates: (exit code, summary json, report dir)."""
    out = tmp_path_factory.mktemp("report")
    argv = ["eval", "--reference", str(tiny_trained), "--model", str(tiny_trained), "--model", str(tiny_awq_autoawq),
            "--model", str(tiny_ct), "--model", str(damaged_dir), "--data", str(val_txt),
            "--max-tokens", str(MAX_TOKENS),
            "--context-len", str(CONTEXT), "--task-limit", "4", "--layer-windows", "1", "--out", str(out)]
    code = main(argv)
    return code, json.loads((out / "report.json").read_text()), out


def candidate(summary: dict, name: str) -> dict:
    return next(c for c in summary["candidates"] if c["name"] == name)


# ---- the independent computation: transformers fp32, windows cut here ----------------------------------------
def unpack_int4(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C/8] int32 -> [R, C] values 0..15; nibble i (bits 4i..4i+3) of word w is column 8w + i, or the
    AWQ interleave when order is given."""
    nibbles = (packed.unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF     # [R, C/8, 8]
    if order is not None:
        nibbles = nibbles[..., order]
    return nibbles.reshape(packed.shape[0], -1).long()


def dequantized_state_dict(model_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint as the plain fp32 state dict of the FP16 architecture."""
    raw = {}
    for file in glob.glob(str(model_dir / "*.safetensors")):
        with safe_open(file, "pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for name, t in raw.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qweight":                          # AutoAWQ gemm: W[k, n] = (q - z) * s, group along k
            q, z = unpack_int4(t, AWQ_REVERSE), unpack_int4(raw[prefix + ".qzeros"], AWQ_REVERSE)
            s = raw[prefix + ".scales"].float()
            g = q.shape[0] // s.shape[0]
            out[prefix + ".weight"] = ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).t()
        elif leaf == "weight_packed":                  # compressed-tensors pack-quantized, symmetric: (q - 8) * s
            q, s = unpack_int4(t), raw[prefix + ".weight_scale"].float()
            out[prefix + ".weight"] = (q - 8) * s.repeat_interleave(q.shape[1] // s.shape[1], 1)
        elif leaf in ("qzeros", "scales", "weight_scale", "weight_shape"):
            continue
        else:
            out[name] = t.float()
    return out


@pytest.fixture(scope="module")
def hf_logprobs(tiny_trained, tiny_awq_autoawq, tiny_ct, val_txt):
    """name -> [scored tokens, vocab] log-probs from transformers, on windows cut independently of eval/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tiny_trained).encode(val_txt.read_text())[:MAX_TOKENS]
    model = AutoModelForCausalLM.from_pretrained(tiny_trained, dtype=torch.float32).eval()
    reference_state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    for name, state in (("tiny-qwen2", None), ("tiny-qwen2-awq", tiny_awq_autoawq),
                        ("tiny-qwen2-w4a16-ct", tiny_ct)):
        model.load_state_dict(reference_state if state is None else dequantized_state_dict(state), strict=False)
        rows = []
        with torch.no_grad():
            for start in range(0, len(ids), CONTEXT):
                window = torch.tensor([ids[start:start + CONTEXT]])
                rows.append(torch.log_softmax(model(window).logits[0, :-1].float(), dim=-1))
        out[name] = torch.cat(rows)
    targets = torch.tensor([t for s in range(0, len(ids), CONTEXT) for t in ids[s + 1:s + CONTEXT]])
    return out, targets


def hf_stats(hf_logprobs, name: str) -> dict:
    logprobs, targets = hf_logprobs
    lc, lr = logprobs[name], logprobs["tiny-qwen2"]
    nll = -lc.gather(1, targets[:, None]).double().mean().item()
    kld = (lr.exp() * (lr - lc)).sum(-1).double().mean().item()
    top1 = (lc.argmax(-1) == lr.argmax(-1)).double().mean().item()
    return {"perplexity": math.exp(nll), "kld": kld, "top1": top1}


# ---- tests ----------------------------------------------------------------------------------------------------
def test_fp16_against_itself(run, hf_logprobs):
    _, summary, _ = run
    same = candidate(summary, "tiny-qwen2")
    assert abs(same["kld"]) < 1e-6 and same["top1"] == 1.0 and same["abs_delta_p_mean"] == 0.0
    assert summary["reference"]["num_tokens"] == MAX_TOKENS - MAX_TOKENS // CONTEXT
    expected = hf_stats(hf_logprobs, "tiny-qwen2")["perplexity"]
    assert summary["reference"]["perplexity"] == pytest.approx(expected, rel=0.005)
    assert same["perplexity"] == summary["reference"]["perplexity"]
    assert same["layers"] == []                     # nothing quantized: no per-layer rows


@pytest.mark.parametrize("name", ["tiny-qwen2-awq", "tiny-qwen2-w4a16-ct"])
def test_third_party_checkpoints_match_transformers(run, hf_logprobs, name):
    _, summary, _ = run
    got, expected = candidate(summary, name), hf_stats(hf_logprobs, name)
    assert got["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-3)
    assert got["kld"] == pytest.approx(expected["kld"], rel=0.01, abs=1e-4)
    assert got["top1"] == pytest.approx(expected["top1"], abs=0.003)
    assert 0.01 < got["kld"] < 0.2 and 0.75 < got["top1"] < 0.97      # a real, moderate quantization error
    assert len(got["layers"]) == 56 and got["format"].startswith(("awq", "compressed-tensors"))
    # AutoAWQ folded smoothing scales into the norms and up_proj (undone before comparing); llm-compressor did not.
    assert any(e["compensated"] for e in got["layers"]) == (name == "tiny-qwen2-awq")
    assert max(e["rel_error"] for e in got["layers"]) < 0.3
    for task in ("definitions", "definitions_gen"):
        assert got["tasks"][task]["num_items"] == 4 and 0 <= got["tasks"][task]["accuracy"] <= 1


def test_damaged_model_fails_the_default_gate(run):
    code, summary, report_dir = run
    assert code == 1 and not summary["gate"]["passed"]
    damaged = candidate(summary, "tiny-qwen2-awq-damaged")
    assert damaged["layers"][0]["name"] == DAMAGED
    assert damaged["layers"][0]["rel_error"] > 2.0 > damaged["layers"][1]["rel_error"]
    checks = {f["check"] for f in summary["gate"]["failed"] if f["candidate"] == damaged["name"]}
    assert {"ppl_increase_pct", "kld", "top1"} <= checks
    assert not [f for f in summary["gate"]["failed"] if f["candidate"] == "tiny-qwen2"]
    assert "FAILED tiny-qwen2-awq-damaged: kld" in (report_dir / "report.md").read_text()


def test_html_report_renders_in_chromium(run, tmp_path):
    _, _, report_dir = run
    html = report_dir / "report.html"
    assert html.stat().st_size < 1_000_000
    text = html.read_text()
    assert "<script" not in text and "http://" not in text and "https://" not in text   # self-contained
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} missing: apt-get install -y chromium")
    png = tmp_path / "report.png"
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={png}", "--window-size=1200,2000", f"file://{html}"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and png.is_file(), result.stderr[-2000:]
    shutil.copy(png, report_dir / "screenshot.png")
    import matplotlib.image
    pixels = matplotlib.image.imread(png)[..., :3]
    assert pixels.shape[:2] == (2000, 1200)
    ink = (pixels.mean(axis=-1) < 0.9).mean()
    assert 0.02 < ink < 0.6, f"{ink:.3f} of the page is non-white"
    assert np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0).shape[0] > 50   # plots, not blank
