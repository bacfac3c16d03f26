"""`quant-serve eval --activation-dtype`: one candidate per activation path, the reference's own weights against
its fp16 path under the gate's [activations] limits, and every report (md, html, json) naming the path each
model ran. On a small random Qwen2 (written in tmp_path) and its RTN quantization."""
import json
import shutil

import pytest
import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.eval.harness import EvalConfig, plan_candidates
from quant_serve.server.cli.main import main

TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "def main():\n    return 0\n" * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(fp16 dir, RTN g128 dir, data file) of a 2-layer random Qwen2 with the demo model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    root = tmp_path_factory.mktemp("act8")
    fp16 = root / "tiny-fp16"
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(cfg).to(torch.float16).save_pretrained(str(fp16))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, fp16 / name)
    rtn = root / "tiny-rtn"
    assert main(["quantize", str(fp16), str(rtn), "--method", "rtn", "--device", "cpu"]) == 0
    data = root / "text.txt"
    data.write_text(TEXT)
    return fp16, rtn, data


def _eval(*args: str) -> list[str]:
    return ["eval", *args, "--max-tokens", "256", "--context-len", "128", "--tasks", "none", "--layer-windows", "0",
            "--device", "cpu"]


def test_candidates_per_activation_path():
    cfg = EvalConfig(reference="r/ref", models=["a/awq"], activation_dtypes=["fp16", "int8"],
                     act_scales=["token", "group"])
    got = [(c.name, c.activation_dtype, c.act_scale, c.act_only) for c in plan_candidates(cfg)]
    assert got == [("awq a=fp16", "fp16", "token", False), ("awq a=int8/token", "int8", "token", False),
                   ("awq a=int8/group", "int8", "group", False)]
    assert [c.name for c in plan_candidates(EvalConfig(reference="r/ref", models=["a/awq"]))] == ["awq"]
    own = plan_candidates(EvalConfig(reference="r/awq", activation_dtypes=["fp16", "int8"], act_scales=["token"]))
    assert [(c.name, c.model_dir, c.act_only) for c in own] == [("awq a=int8/token", "r/awq", True)]
    with pytest.raises(ValueError, match="--activation-dtype int8"):
        plan_candidates(EvalConfig(reference="r/awq"))


def test_reports_name_the_path_of_each_candidate(tiny, tmp_path):
    fp16, rtn, data = tiny
    out = tmp_path / "report"
    rc = main(_eval("--reference", str(fp16), "--model", str(rtn), "--data", str(data), "--activation-dtype",
                    "fp16", "int8", "--act-scale", "token", "--out", str(out)))
    assert rc in (0, 1)                                   # a random model may fail the default gate
    summary = json.loads((out / "report.json").read_text())
    assert summary["reference"]["activations"]["resolved"] == "-"             # unquantized: nothing to resolve
    got = {c["name"]: c["activations"] for c in summary["candidates"]}
    assert got["tiny-rtn a=fp16"]["resolved"] == "fp16"
    assert got["tiny-rtn a=int8/token"]["resolved"] == "int8/token"
    assert got["tiny-rtn a=int8/token"]["layers"] == [{"format": "awq", "path": "int8/token", "count": 8}]
    fp, a8 = summary["candidates"]
    assert fp["perplexity"] != a8["perplexity"]
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| tiny-rtn a=int8/token | fp32 | int8/token |" in md
    assert "| tiny-rtn a=fp16 | fp32 | fp16 |" in md
    assert "<td>int8/token</td>" in html
    assert "--activation-dtype fp16 int8 --act-scale token" in summary["metadata"]["command"]


def test_own_weights_against_their_fp16_path_use_the_activation_limits(tiny, tmp_path, capsys):
    _, rtn, data = tiny
    gate = tmp_path / "gate.toml"
    gate.write_text("max_kld = 1.0\n[activations]\nmax_kld = 0.0\n")
    rc = main(_eval("--reference", str(rtn), "--data", str(data), "--activation-dtype", "int8", "--act-scale",
                    "group", "--gate", str(gate), "--json"))
    summary = json.loads(capsys.readouterr().out)
    assert summary["reference"]["activations"]["resolved"] == "fp16"          # the reference runs fp16 always
    (cand,) = summary["candidates"]
    assert cand["name"] == "tiny-rtn a=int8/group" and cand["act_only"] and cand["kld"] > 0
    assert rc == 1 and [f["check"] for f in summary["gate"]["failed"]] == ["kld"]
    assert summary["gate"]["failed"][0]["limit"] == 0.0
