"""The report's bar labels sit clear of their error bars (rendered with matplotlib, compared in pixels)."""
import json

import pytest

from conftest import REPO

pytest.importorskip("matplotlib")
from quant_serve.eval import plots  # noqa: E402


def test_bar_labels_do_not_overlap_error_bars(monkeypatch):
    summary = json.loads((REPO / "bench" / "results" / "eval" / "tiny-qwen2" / "report.json").read_text())
    summary["candidates"][1]["ppl_change_pct"] = -0.8     # a candidate better than the reference: label on the left
    figures = []
    monkeypatch.setattr(plots, "to_base64", lambda fig: figures.append(fig) or "")
    plots.ppl_kld_figure(summary)
    fig = figures[0]
    fig.canvas.draw()                      # limits and margins settle at draw time
    renderer = fig.canvas.get_renderer()
    cap = 3 * fig.dpi / 72                  # capsize=3 points, in pixels
    checked = 0
    for ax in fig.axes:
        segments = [ax.transData.transform(s) for c in ax.collections for s in c.get_segments()]   # xerr lines
        for text in ax.texts:
            box = text.get_window_extent(renderer)
            for (x0, y), (x1, _) in segments:
                hit_y = box.y0 - cap <= y <= box.y1 + cap
                hit_x = box.x0 <= max(x0, x1) + cap and min(x0, x1) - cap <= box.x1
                assert not (hit_y and hit_x), (ax.get_title(), text.get_text())
            assert box.x0 >= ax.bbox.x0 and box.x1 <= ax.bbox.x1, ("label leaves its panel", text.get_text())
            checked += 1
    assert checked == 3 * len(summary["candidates"])
