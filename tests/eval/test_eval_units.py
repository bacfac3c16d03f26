"""quant-serve eval without models: windows, statistics, gate parsing and the CLI's exit codes and reports
(on a synthetic result, so the report and gate code paths are checked in seconds)."""
import json
from pathlib import Path

import numpy as np
import pytest

from quant_serve.eval.compare import TokenStats, kl_divergence
from quant_serve.eval.data import make_windows
from quant_serve.eval.gate import load_gate
from quant_serve.eval.harness import EvalConfig, EvalResult, ModelResult
from quant_serve.eval.layer_error import LayerError
from quant_serve.eval.tasks import GENERATION, MULTIPLE_CHOICE, TaskResult, load_task, wilson_interval
from quant_serve.server.cli.main import main


def test_disjoint_windows_score_all_but_each_first_token():
    ids = list(range(1030))
    windows = make_windows(ids, 512, 512)
    assert [w.start for w in windows] == [0, 512, 1024]
    assert [w.num_scored for w in windows] == [511, 511, 5]
    assert windows[1].targets == list(range(513, 1024))


def test_strided_windows_score_every_token_once():
    ids = list(range(1000))
    windows = make_windows(ids, 512, 256)
    scored = [w.start + i for w in windows for i in range(w.first_scored, len(w.tokens))]
    assert scored == list(range(1, 1000))
    assert all(len(w.tokens) <= 512 for w in windows)
    with pytest.raises(ValueError, match="stride"):
        make_windows(ids, 512, 1024)


def test_wilson_interval():
    low, high = wilson_interval(70, 100)
    assert low == pytest.approx(0.6041, abs=1e-3) and high == pytest.approx(0.7810, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_kl_divergence_of_identical_and_known_distributions():
    import torch
    lp = torch.log_softmax(torch.randn(300, 50), dim=-1)
    assert kl_divergence(lp, lp).abs().max() == 0
    p, q = torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.9, 0.1]]).log()
    expected = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    assert kl_divergence(p, q).item() == pytest.approx(expected, rel=1e-6)


def test_shipped_tasks_load():
    mc = load_task("definitions")
    assert mc.kind == MULTIPLE_CHOICE and 300 <= len(mc.items) <= 500
    assert all(len(item["choices"]) == 4 for item in mc.items)
    gen = load_task("definitions_gen", limit=5)
    assert gen.kind == GENERATION and len(gen.items) == 5
    assert gen.items[0]["answer"].endswith(")")


def test_gate_parsing(tmp_path):
    default = load_gate()
    assert default.weights.max_kld is not None and default.kv_cache.max_ppl_increase_pct is not None
    path = tmp_path / "g.toml"
    path.write_text("max_kld = 0.05\n[kv_cache]\nmin_top1 = 0.99\n")
    gate = load_gate(path)
    assert gate.weights.max_kld == 0.05 and gate.weights.min_top1 is None
    assert gate.kv_cache.max_kld == 0.05 and gate.kv_cache.min_top1 == 0.99     # kv_cache inherits, overrides
    for text, message in (("max_kdl = 1", "unknown gate key"), ("min_top1 = 80", "fraction"),
                          ("max_kld = 'x'", "must be a number"), ("max_kld = ", "invalid TOML")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_gate(path)
    with pytest.raises(FileNotFoundError):
        load_gate(tmp_path / "missing.toml")


def _model(name: str, nll_shift: float, kld: float, top1: float, acc: float, kv_only=False) -> ModelResult:
    rng = np.random.default_rng(0)
    n = 1000
    nll = rng.uniform(1.0, 4.0, n) + nll_shift
    stats = TokenStats(nll=nll)
    if name != "ref":
        stats = TokenStats(nll=nll, kld=np.full(n, kld), top1=np.arange(n) < top1 * n,
                           delta_p=rng.normal(0, 0.05, n))
    correct = [i < acc * 100 for i in range(100)]
    tasks = {"mc": TaskResult("mc", MULTIPLE_CHOICE, correct, correct)}
    layers = [LayerError(f"model.layers.{i}.mlp.down_proj", 0.1 * (i + 1), 512) for i in range(3)]
    return ModelResult(name, f"/m/{name}", "fp32", kv_only, "awq", "abc", "float32", stats, tasks,
                       layers if name != "ref" else [])


def _fake_result(bad: bool) -> EvalResult:
    cfg = EvalConfig(reference="/m/ref", models=["/m/good"], data=["/d/val.txt"])
    cands = [_model("good", 0.01, 0.02, 0.95, 0.70),
             _model("ref kv=fp8_e4m3", 0.001, 0.001, 0.99, 0.71, kv_only=True)]
    if bad:
        cands.append(_model("bad", 0.5, 0.9, 0.5, 0.40))
    return EvalResult(cfg, _model("ref", 0.0, 0, 0, 0.71), cands, 4, 1000, "cpu")


@pytest.mark.parametrize("bad", [False, True])
def test_cli_exit_codes_and_reports(monkeypatch, tmp_path, capsys, bad):
    monkeypatch.setattr("quant_serve.eval.harness.run_eval", lambda cfg: _fake_result(bad))
    out = tmp_path / "report"
    code = main(["eval", "--reference", "/m/ref", "--model", "/m/good", "--data", "/d/val.txt", "--json",
                 "--out", str(out)])
    summary = json.loads(capsys.readouterr().out)
    assert code == (1 if bad else 0)
    assert summary["gate"]["passed"] is not bad
    assert {"perplexity"} <= set(summary["reference"])
    for c in summary["candidates"]:
        assert {"name", "perplexity", "kld", "top1", "tasks"} <= set(c)
    failed = {(f["candidate"], f["check"]) for f in summary["gate"]["failed"]}
    if bad:
        assert failed == {("bad", "ppl_increase_pct"), ("bad", "kld"), ("bad", "top1"), ("bad", "task_drop[mc]")}
    md = (out / "report.md").read_text()
    assert ("FAILED bad: kld" in md) == bad
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4 and "<script" not in html
    assert json.loads((out / "report.json").read_text())["gate"] == summary["gate"]


def test_cli_error_exit_code(tmp_path, capsys):
    bad_gate = tmp_path / "gate.toml"
    bad_gate.write_text("max_kld = [1]\n")
    argv = ["eval", "--reference", "/m/ref", "--model", "/m/x", "--data", "/nonexistent.txt"]
    assert main(argv + ["--gate", str(bad_gate)]) == 2
    assert "must be a number" in capsys.readouterr().err
    assert main(argv) == 2
    assert "does not exist" in capsys.readouterr().err


def test_lm_eval_command_line():
    from quant_serve.eval.lm_eval_adapter import local_completions_command
    argv = local_completions_command("http://127.0.0.1:8000/", "tiny", ["hellaswag", "arc_easy"])
    assert argv[:4] == ["lm_eval", "run", "--model", "local-completions"]
    assert "base_url=http://127.0.0.1:8000/v1/completions" in argv[5] and argv[-1] == "hellaswag,arc_easy"


def test_eval_package_imports_no_server():
    root = Path(__file__).resolve().parents[2] / "eval"
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "from server" not in text and "import server" not in text, path
        assert len(text.splitlines()) < 300, path
