"""The machine-readable summary (report.json, `--json`) and report.md. The HTML report is eval/report_html.py."""
import json
import math
from pathlib import Path

from quant_serve.eval.gate import GateResult
from quant_serve.eval.harness import EvalResult, ModelResult

TOP_LAYERS = 10           # per-layer rows listed per candidate in the summary and the markdown


def _model_json(m: ModelResult) -> dict:
    out = {"name": m.name, "model_dir": m.model_dir, "hash": m.hash, "format": m.format, "dtype": m.dtype,
           "kv_cache_dtype": m.kv_cache_dtype, "kv_only": m.kv_only, "act_only": m.act_only,
           "activations": m.activations or {"resolved": "-"}}
    out.update(m.stats.summary())
    out["tasks"] = {name: t.summary() for name, t in m.tasks.items()}
    if m.kv_scales:
        out["kv_scales"] = m.kv_scales
    return out


def summary_json(result: EvalResult, metadata: dict, gate: GateResult | None = None) -> dict:
    ref = _model_json(result.reference)
    candidates = []
    for m in result.candidates:
        c = _model_json(m)
        c["ppl_change_pct"] = 100.0 * (c["perplexity"] / ref["perplexity"] - 1.0)
        # Paired over the same tokens (llama.cpp's ln(PPL(Q)/PPL(base)) +- SE): far tighter than either PPL's error.
        d = m.stats.nll - result.reference.stats.nll
        c["ppl_change_pct_stderr"] = 100.0 * math.exp(float(d.mean())) * float(d.std(ddof=1)) / math.sqrt(len(d)) \
            if len(d) > 1 else 0.0
        for name, task in c["tasks"].items():
            if name in ref["tasks"]:
                task["drop"] = ref["tasks"][name]["accuracy"] - task["accuracy"]
        c["layers"] = [{"name": e.name, "rel_error": e.rel_error, "compensated": e.compensated} for e in m.layers]
        candidates.append(c)
    cfg = result.config
    out = {"reference": ref, "candidates": candidates,
           "protocol": {"data": cfg.data, "max_tokens": cfg.max_tokens, "context_len": cfg.context_len,
                        "stride": cfg.stride, "num_windows": result.num_windows, "num_scored_tokens":
                        result.num_tokens, "layer_windows": cfg.layer_windows, "tasks": cfg.tasks,
                        "task_limit": cfg.task_limit, "device": result.device},
           "metadata": metadata}
    if gate is not None:
        out["gate"] = gate.to_json()
    return out


def layer_note(cand: dict, proto: dict) -> str:
    layers = cand["layers"]
    note = (f"Relative output error ||W_q x - W x|| / ||W x|| of each quantized linear on the reference's "
            f"activations ({proto['layer_windows']} windows); worst {min(TOP_LAYERS, len(layers))} of {len(layers)}.")
    if any(e["compensated"] for e in layers):
        note += (" * = smoothing scales the checkpoint folded into the previous op (AWQ-style) were undone "
                 "before comparing.")
    return note


def activations_label(m: dict) -> str:
    """The activation path a model ran, with the request where auto resolved it."""
    act = m.get("activations") or {"resolved": "-"}
    if act.get("requested") == "auto" and act["resolved"] != "-":
        return f"{act['resolved']} (auto)"
    return act["resolved"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(summary: dict, gate_source: str | None = None) -> str:
    ref, cands, proto, meta = summary["reference"], summary["candidates"], summary["protocol"], summary["metadata"]
    lines = ["# quant-serve eval report", ""]
    lines += [f"Reference **{ref['name']}** ({ref['format']}, {ref['dtype']}); {proto['num_scored_tokens']:,} "
              f"scored tokens in {proto['num_windows']} windows of {proto['context_len']} (stride {proto['stride']}) "
              f"from {', '.join(Path(d).name for d in proto['data'])}; device {proto['device']}.", ""]
    gate = summary.get("gate")
    if gate is not None:
        lines += [f"## Gate: {'PASSED' if gate['passed'] else 'FAILED'}", ""]
        if gate_source:
            lines += [f"Thresholds from `{gate_source}`; {len(gate['checked'])} checks.", ""]
        lines += [f"- FAILED {f['message']}" for f in gate["failed"]] + ([""] if gate["failed"] else [])
    lines += ["## Perplexity and logit comparison", "",
              "| config | KV | activations | perplexity | change | KLD | KLD p99 | top-1 | mean abs dp | p99 abs dp |",
              "|---|---|---|---|---|---|---|---|---|---|",
              f"| {ref['name']} (reference) | {ref['kv_cache_dtype']} | {activations_label(ref)} "
              f"| {ref['perplexity']:.3f} +- {ref['perplexity_stderr']:.3f} | - | - | - | - | - | - |"]
    for c in cands:
        lines.append(f"| {c['name']} | {c['kv_cache_dtype']} | {activations_label(c)} "
                     f"| {c['perplexity']:.3f} +- {c['perplexity_stderr']:.3f} "
                     f"| {c['ppl_change_pct']:+.2f}% +- {c['ppl_change_pct_stderr']:.2f} "
                     f"| {c['kld']:.4f} +- {c['kld_stderr']:.4f} | {c['kld_p99']:.3f} "
                     f"| {_pct(c['top1'])} | {_pct(c['abs_delta_p_mean'])} | {_pct(c['abs_delta_p_p99'])} |")
    lines += ["", "KLD: mean KL(reference || candidate) per token in nats. dp: p_candidate - p_reference of the "
              "correct token. +- one standard error (the change in perplexity paired over the same tokens). "
              "activations: the path the quantized layers ran (fp16: W4A16 / W8A16 in the model's dtype; "
              "int8/token, int8/group: quantized on the fly per token or per token and weight group), as "
              "--activation-dtype resolved it.", ""]
    task_names = list(ref["tasks"])
    if task_names:
        lines += ["## Tasks", "", "| config | " + " | ".join(
            f"{t} ({ref['tasks'][t]['metric']}, n={ref['tasks'][t]['num_items']})" for t in task_names) + " |",
            "|---|" + "---|" * len(task_names)]
        for m in [ref] + cands:
            cells = []
            for t in task_names:
                r = m["tasks"][t]
                drop = f", {-100 * r['drop']:+.1f} pt" if "drop" in r else ""
                cells.append(f"{_pct(r['accuracy'])} [{_pct(r['ci95'][0])}, {_pct(r['ci95'][1])}]{drop}")
            lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
        lines += ["", "Accuracy with its 95% Wilson interval; pt: change against the reference in points.", ""]
    for c in cands:
        if c["layers"]:
            lines += [f"## Per-layer error: {c['name']}", "", layer_note(c, proto), "",
                      "| rank | module | rel. error |", "|---|---|---|"]
            lines += [f"| {i} | {e['name']}{' *' if e['compensated'] else ''} | {e['rel_error']:.4f} |"
                      for i, e in enumerate(c["layers"][:TOP_LAYERS], 1)]
            lines.append("")
    lines += ["## Run", "", "| model | dir | hash | format | dtype |", "|---|---|---|---|---|"]
    for m in [ref] + cands:
        lines.append(f"| {m['name']} | `{m['model_dir']}` | {m['hash']} | {m['format']} | {m['dtype']} |")
    hw = meta["hardware"]
    lines += ["", f"- date: {meta['date']}", f"- git commit: {meta['git_commit']}",
              f"- hardware: {hw.get('gpu') or hw['cpu']} ({hw['device']}, {hw['cpu_count']} threads)",
              f"- torch {meta['torch']}, transformers {meta['transformers']}, python {meta['python']}",
              f"- command: `{meta['command']}`", ""]
    return "\n".join(lines)


def check_out_dir(out_dir: str | Path) -> Path:
    """Create the report folder and prove it is writable (before the evaluation, not after)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-check"
        probe.write_text("", encoding="utf-8")
        probe.unlink()
    except OSError as e:
        raise OSError(f"cannot write the report to --out {out}: {e.strerror or e}") from e
    return out


def write_text_reports(out_dir: str | Path, summary: dict, gate_source: str | None = None) -> None:
    """report.json and report.md: written first, so that nothing measured is lost if the plots fail."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown(summary, gate_source), encoding="utf-8")


def write_html_report(out_dir: str | Path, html: str) -> None:
    (Path(out_dir) / "report.html").write_text(html, encoding="utf-8")
