"""Matplotlib figures for the HTML report, returned as base64 PNG so the page is one self-contained file."""
import base64
import io
import re

import numpy as np

DPI = 80      # keeps a report with a handful of candidates well under 1 MB


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the HTML report needs matplotlib, a dependency of quant-serve that is missing "
                                  "from this environment: pip install 'matplotlib>=3.8'") from e
    matplotlib.use("Agg")           # headless; must precede the pyplot import
    import matplotlib.pyplot as plt
    return plt


def check_plotting() -> None:
    """Draw and encode one small figure: eval calls this before any model loads, so a broken matplotlib stops the
    run in a second instead of after the evaluation."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [0, 1])
    to_base64(fig)


def to_base64(fig) -> str:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def ppl_kld_figure(summary: dict) -> str:
    """Three panels over the candidates: perplexity change (paired error bars), mean KLD, top-1 agreement."""
    plt = _pyplot()
    cands = summary["candidates"]
    names = [c["name"] for c in cands]
    fig, axes = plt.subplots(1, 3, figsize=(13, max(2.2, 0.45 * len(names) + 1)))
    y = np.arange(len(names))
    panels = [("perplexity change vs reference (%)", [c["ppl_change_pct"] for c in cands],
               [c["ppl_change_pct_stderr"] for c in cands], "#4c72b0"),
              ("mean KLD vs reference (nats)", [c["kld"] for c in cands], [c["kld_stderr"] for c in cands],
               "#dd8452"),
              ("top-1 agreement (%)", [100 * c["top1"] for c in cands], [100 * c["top1_stderr"] for c in cands],
               "#55a868")]
    for i, (ax, (title, values, errors, color)) in enumerate(zip(axes, panels)):
        ax.barh(y, values, xerr=errors, color=color, capsize=3)
        for yi, v, err in zip(y, values, errors):
            # beyond the error bar's cap, on the side the bar grows to, so the number never sits on the bar
            side = 1 if v >= 0 else -1
            ax.annotate(f"{v:.3g}", (v + side * err, yi), xytext=(side * 5, 0), textcoords="offset points",
                        va="center", ha="left" if side > 0 else "right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_yticks(y, names if i == 0 else [""] * len(names))
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.25)      # room for the labels beyond the error bars
    axes[2].set_xlim(max(0, min(100 * c["top1"] for c in cands) - 10), 100.5)
    return to_base64(fig)


def delta_p_figure(abs_delta_p: dict[str, np.ndarray]) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bins = np.linspace(0, 1, 51)
    for name, values in abs_delta_p.items():
        ax.hist(values, bins=bins, histtype="step", lw=1.5, label=f"{name} (p99 {np.percentile(values, 99):.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("|p_candidate - p_reference| of the correct token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return to_base64(fig)


_KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def layer_error_figure(name: str, layers: list[dict]) -> str:
    """Grouped bars: x = decoder layer, one bar per linear kind; the worst module is annotated."""
    plt = _pyplot()
    table: dict[str, dict[int, float]] = {}
    for e in layers:
        match = re.search(r"layers\.(\d+)\..*?([A-Za-z_]+(?:\[\d+\])?)$", e["name"])
        layer, kind = (int(match.group(1)), match.group(2)) if match else (-1, e["name"])
        table.setdefault(kind, {})[layer] = e["rel_error"]
    kinds = [k for k in _KINDS if k in table] + sorted(k for k in table if k not in _KINDS)
    num_layers = max(max(v) for v in table.values()) + 1
    fig, ax = plt.subplots(figsize=(min(16, 3 + 0.55 * num_layers * len(kinds) / 4), 3.8))
    width = 0.8 / len(kinds)
    for j, kind in enumerate(kinds):
        xs = sorted(table[kind])
        ax.bar(np.array(xs) + (j - (len(kinds) - 1) / 2) * width, [table[kind][x] for x in xs], width, label=kind)
    worst = layers[0]
    ax.set_title(f"{name}: relative output error per linear (worst: {worst['name']} = {worst['rel_error']:.3f})",
                 fontsize=10)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("||W_q x - W x|| / ||W x||")
    ax.set_xticks(range(num_layers))
    ax.legend(fontsize=7, ncol=len(kinds))
    ax.grid(axis="y", alpha=0.3)
    return to_base64(fig)


def task_figure(summary: dict) -> str:
    plt = _pyplot()
    models = [summary["reference"]] + summary["candidates"]
    tasks = list(summary["reference"]["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), max(2.5, 0.45 * len(models) + 1)),
                             squeeze=False)
    y = np.arange(len(models))
    for ax, task in zip(axes[0], tasks):
        acc = np.array([100 * m["tasks"][task]["accuracy"] for m in models])
        lo = np.array([100 * m["tasks"][task]["ci95"][0] for m in models])
        hi = np.array([100 * m["tasks"][task]["ci95"][1] for m in models])
        ax.barh(y, acc, xerr=[acc - lo, hi - acc], color=["#8172b3"] + ["#64b5cd"] * (len(models) - 1), capsize=3)
        ax.set_yticks(y, [m["name"] for m in models] if ax is axes[0][0] else [""] * len(models))
        ax.set_ylim(len(models) - 0.5, -0.5)
        ax.set_xlim(0, 100)
        ax.set_title(f"{task} ({summary['reference']['tasks'][task]['metric']}, %, 95% Wilson)", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    return to_base64(fig)
