"""`quant-serve eval` never throws its run away: what the report needs (matplotlib, a writable --out, the gate) is
checked before any model loads, and report.json / report.md are written before the plots, so a failure while
drawing keeps the numbers."""
import importlib.metadata
import json
import re

import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.eval import harness, plots
from quant_serve.server.cli.main import main as cli

TEXT = ("The lantern hung from a hook by the door. A lantern is a lamp with a transparent case protecting the flame. "
        "She carried it down the path to the river, where the boats were tied for the night.\n") * 8


def _eval_args(tmp_path, out):
    data = tmp_path / "heldout.txt"
    data.write_text(TEXT)
    return ["eval", "--reference", str(DEMO_MODEL_DIR), "--model", str(DEMO_MODEL_DIR), "--data", str(data),
            "--out", str(out), "--max-tokens", "128", "--context-len", "64", "--tasks", "none",
            "--layer-windows", "0", "--device", "cpu"]


def test_matplotlib_and_tomli_are_dependencies_not_extras():
    requires = importlib.metadata.requires("quant-serve")
    core = [r for r in requires if "extra ==" not in r]
    assert any(re.match(r"matplotlib\b", r) for r in core), core
    assert any(re.match(r"tomli\b", r) for r in core), core


def test_a_broken_plotting_library_stops_eval_before_any_model_loads(tmp_path, monkeypatch, capsys):
    def no_pyplot():
        raise ModuleNotFoundError("the HTML report needs matplotlib")
    monkeypatch.setattr(plots, "_pyplot", no_pyplot)
    monkeypatch.setattr(harness, "make_engine", lambda *a, **k: pytest.fail("a model loaded before the check"))
    assert cli(_eval_args(tmp_path, tmp_path / "report")) == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_an_unwritable_out_stops_eval_before_any_model_loads(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(harness, "make_engine", lambda *a, **k: pytest.fail("a model loaded before the check"))
    assert cli(_eval_args(tmp_path, blocker / "report")) == 2
    assert "cannot write the report to --out" in capsys.readouterr().err


def test_the_numbers_survive_a_failure_while_drawing(tmp_path, monkeypatch):
    out = tmp_path / "report"

    def broken_html(*args, **kwargs):
        raise RuntimeError("drawing failed")
    monkeypatch.setattr("quant_serve.eval.report_html.html_report", broken_html)
    assert cli(_eval_args(tmp_path, out)) == 2
    summary = json.loads((out / "report.json").read_text())
    assert summary["candidates"][0]["perplexity"] > 1
    assert "perplexity" in (out / "report.md").read_text().lower()
    assert not (out / "report.html").exists()
