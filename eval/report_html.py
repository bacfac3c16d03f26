"""report.html: one self-contained page (inline CSS, plots as base64 PNG), no scripts, no external resources."""
from html import escape
from pathlib import Path

from quant_serve.eval import plots
from quant_serve.eval.report import TOP_LAYERS, activations_label, layer_note

CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:1.5em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0;font-size:14px}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left}th{background:#f0f0f0}
.pass{color:#1a7f37;font-weight:bold}.fail{color:#c62828;font-weight:bold}img{max-width:100%}
code{background:#f4f4f4;padding:1px 4px}.small{color:#666;font-size:13px}"""


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(data: str, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def html_report(summary: dict, abs_delta_p: dict, gate_source: str | None = None) -> str:
    """summary: report.summary_json; abs_delta_p: candidate name -> per-token |dp| array (for the histogram)."""
    ref, cands, proto, meta = summary["reference"], summary["candidates"], summary["protocol"], summary["metadata"]
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>quant-serve eval report</title>",
             f"<style>{CSS}</style></head><body><h1>quant-serve eval report</h1>",
             f"<p>Reference <b>{escape(ref['name'])}</b> ({escape(ref['format'])}, {escape(ref['dtype'])}); "
             f"{proto['num_scored_tokens']:,} scored tokens in {proto['num_windows']} windows of "
             f"{proto['context_len']} (stride {proto['stride']}) from "
             f"{escape(', '.join(Path(d).name for d in proto['data']))}; device {escape(proto['device'])}.</p>"]
    gate = summary.get("gate")
    if gate is not None:
        verdict = "<span class='pass'>PASSED</span>" if gate["passed"] else "<span class='fail'>FAILED</span>"
        parts.append(f"<h2>Gate: {verdict}</h2><p class='small'>Thresholds from <code>{escape(gate_source or '')}"
                     f"</code>; {len(gate['checked'])} checks.</p>")
        if gate["failed"]:
            parts.append("<ul>" + "".join(f"<li class='fail'>{escape(f['message'])}</li>" for f in gate["failed"])
                         + "</ul>")
    rows = [[f"{ref['name']} (reference)", ref["kv_cache_dtype"], activations_label(ref),
             f"{ref['perplexity']:.3f} ± {ref['perplexity_stderr']:.3f}", "-", "-", "-", "-", "-", "-"]]
    for c in cands:
        rows.append([c["name"], c["kv_cache_dtype"], activations_label(c),
                     f"{c['perplexity']:.3f} ± {c['perplexity_stderr']:.3f}",
                     f"{c['ppl_change_pct']:+.2f}% ± {c['ppl_change_pct_stderr']:.2f}",
                     f"{c['kld']:.4f} ± {c['kld_stderr']:.4f}",
                     f"{c['kld_p99']:.3f}", _pct(c["top1"]), _pct(c["abs_delta_p_mean"]),
                     _pct(c["abs_delta_p_p99"])])
    parts += ["<h2>Perplexity and logit comparison</h2>",
              _table(["config", "KV", "activations", "perplexity", "change", "KLD", "KLD p99", "top-1", "mean |Δp|",
                      "p99 |Δp|"], rows),
              "<p class='small'>KLD: mean KL(reference ‖ candidate) per token in nats. Δp: p<sub>candidate</sub> "
              "− p<sub>reference</sub> of the correct token. ± one standard error (the change in perplexity paired "
              "over "
              "the same tokens).</p>",
              _img(plots.ppl_kld_figure(summary), "perplexity, KLD and top-1 by configuration")]
    if abs_delta_p:
        parts += ["<h3>|Δp| of the correct token</h3>", _img(plots.delta_p_figure(abs_delta_p), "|dp| histogram")]
    tasks = list(ref["tasks"])
    if tasks:
        rows = []
        for m in [ref] + cands:
            row = [m["name"]]
            for t in tasks:
                r = m["tasks"][t]
                drop = f" ({-100 * r['drop']:+.1f} pt)" if "drop" in r else ""
                row.append(f"{_pct(r['accuracy'])} [{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]{drop}")
            rows.append(row)
        headers = ["config"] + [f"{t} ({ref['tasks'][t]['metric']}, n={ref['tasks'][t]['num_items']})" for t in tasks]
        parts += ["<h2>Tasks</h2>", _table(headers, rows),
                  "<p class='small'>Accuracy with its 95% Wilson interval; pt: change against the reference.</p>",
                  _img(plots.task_figure(summary), "task accuracy")]
    for c in cands:
        if c["layers"]:
            rows = [[str(i), e["name"] + (" *" if e["compensated"] else ""), f"{e['rel_error']:.4f}"]
                    for i, e in enumerate(c["layers"][:TOP_LAYERS], 1)]
            parts += [f"<h2>Per-layer error: {escape(c['name'])}</h2>",
                      f"<p class='small'>{escape(layer_note(c, proto))}</p>",
                      _img(plots.layer_error_figure(c["name"], c["layers"]), f"per-layer error {c['name']}"),
                      _table(["rank", "module", "rel. error"], rows)]
    rows = [[m["name"], m["model_dir"], m["hash"], m["format"], m["dtype"]] for m in [ref] + cands]
    hw = meta["hardware"]
    parts += ["<h2>Run</h2>", _table(["model", "dir", "hash", "format", "dtype"], rows), "<ul>",
              f"<li>date: {escape(meta['date'])}</li><li>git commit: {escape(str(meta['git_commit']))}</li>",
              f"<li>hardware: {escape(hw.get('gpu') or hw['cpu'])} ({escape(hw['device'])}, {hw['cpu_count']} "
              f"threads)</li><li>torch {escape(meta['torch'])}, transformers {escape(meta['transformers'])}, "
              f"python {escape(meta['python'])}</li><li>command: <code>{escape(meta['command'])}</code></li></ul>",
              "</body></html>"]
    return "\n".join(parts)
