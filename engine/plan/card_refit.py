"""Refit the card model and write engine/plan/card_params.py:

    python -m quant_serve.engine.plan.card_refit bench/results [--write]

Per kernel plan (sm90: the H100 / H200's own; sm86: the plan the A10 / 3090, and the sm89 / sm80 cards, run), the
observations are bench/card_model.py's JSON files in that folder (card-model-*.json) where two GPUs ran that plan,
else the committed runs engine/plan/card_runs.py lists (from different commits). Constants no observation moves are
dropped (their term never binds) or, for weight families a plan has no runs of, taken from the sm90 fit (noted in
`derived`). Where one GPU ran a plan, its DRAM and tensor efficiencies come from the sm90 fit: one bandwidth cannot
tell DRAM from the SMs.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from quant_serve.engine.plan.card_fit import fit, plan_caps, predict
from quant_serve.engine.plan.card_step import CardParams
from quant_serve.engine.plan.card_runs import CHECKS, COMMITTED, card_observations, committed_observations

FAMILIES = ("fp16", "int4", "dequant", "attn_fp16", "attn_fp8", "gguf_q4_0", "gguf_q4_k", "gguf_q5_k", "gguf_q6_k",
            "gguf_q8_0")
# Start where the SM terms bind (so that the fit feels them) and the rest near the datasheet.
START = CardParams(0.85, {"fp16_f32acc": 0.7}, {f: 6.0 for f in FAMILIES},
                   {"mma": 200.0, "wgmma": 500.0, **{f"mma:{f}": 200.0 for f in FAMILIES if f.startswith("gguf")}},
                   3.0, 2.0, 50.0)
PLANS = ("sm90", "sm86")


def card_files(results: Path) -> dict[str, list[tuple[dict, str]]]:
    """bench/card_model.py outputs in `results`, by the kernel plan they ran."""
    out: dict[str, list] = {}
    for path in sorted(results.glob("card-model-*.json")):
        d = json.loads(path.read_text())
        family = plan_caps(d["gpu_key"], d["profile"]).family
        plan = "sm90" if family == "sm90" else "sm86"
        out.setdefault(plan, []).append((d, f"{path.name} ({d['git_commit'][:12]})"))
    return out


def observations(plan: str, results: Path, fit: bool = True):
    """What `plan` is fitted from (fit False: the runs that check it)."""
    runs = card_files(results).get(plan, [])
    if len({d["gpu_key"] for d, _ in runs}) >= 2:
        return [o for d, src in runs for o in card_observations(d, src, fit)]
    return committed_observations(plan, results, COMMITTED if fit else CHECKS)


def _prune(p: CardParams, report: dict) -> CardParams:
    """Drop the SM constants the fit never moved: their term never binds on these runs."""
    dead = set(report["not_fitted"])
    return replace(p, sm_bytes={f: v for f, v in p.sm_bytes.items() if f"sm_bytes:{f}" not in dead},
                   sm_ops={t: v for t, v in p.sm_ops.items() if f"sm_ops:{t}" not in dead})


def fit_plan(plan: str, results: Path, base: CardParams | None = None):
    """-> (params, report, observations) of one plan; base: the sm90 fit, for what this plan's runs cannot give."""
    obs = observations(plan, results)
    one_gpu = len({o.gpu for o in obs}) < 2
    start, fixed = START, ()
    if one_gpu and base is not None:
        start, fixed = replace(START, eta_mem=base.eta_mem, eta_tc=base.eta_tc), ("eta_mem", "eta_tc")
    params, report = fit(obs, start, fixed)
    params = _prune(params, report)
    derived = {name: "the sm90 fit (one GPU ran this plan)" for name in fixed}
    if base is not None:
        seen = {k.family for o in obs for k in o.kernels}
        for f, v in base.sm_bytes.items():
            if f not in seen:
                params.sm_bytes[f], derived[f"sm_bytes:{f}"] = v, "the sm90 fit (no runs of it under this plan)"
        for t, v in base.sm_ops.items():
            if ":" in t and t.split(":")[1] not in seen:
                params.sm_ops[t], derived[f"sm_ops:{t}"] = v, "the sm90 fit (no runs of it under this plan)"
    sources = sorted({o.source for o in obs})
    return replace(params, source="; ".join(sources), derived=derived), report, obs


def fit_all(results: Path) -> dict:
    out = {}
    for plan in PLANS:
        base = out.get("sm90", (None,))[0]
        out[plan] = fit_plan(plan, results, base)
    return out


def _fmt(p: CardParams) -> str:
    pad = " " * 8

    def wrap(items: list[str], sep: str = ", ", width: int = 100) -> str:
        lines, line = [], ""
        for item in items:
            if line and len(line) + len(item) + len(sep) > width:
                lines.append(line + sep.rstrip())
                line = ""
            line = f"{line}{sep}{item}" if line else item
        return f"\n{pad}".join(lines + [line])

    def table(d: dict, fmt) -> str:
        return "{" + wrap([f'"{k}": {fmt(v)}' for k, v in d.items()]) + "}"
    num = "{:.4g}".format
    parts = p.source.split("; ")
    source = wrap([repr(x + ("; " if i < len(parts) - 1 else "")) for i, x in enumerate(parts)], " ")
    return "CardParams(\n" + "".join(f"{pad}{line},\n" for line in (
        f"eta_mem={num(p.eta_mem)}", f"eta_tc={table(p.eta_tc, num)}", f"sm_bytes={table(p.sm_bytes, num)}",
        f"sm_ops={table(p.sm_ops, num)}", f"launch_us={num(p.launch_us)}, small_us={num(p.small_us)}, "
        f"step_us={num(p.step_us)}", f"source=({source})", f"derived={table(p.derived, repr)}")) + "    )"


def params_source(fits: dict) -> str:
    body = ",\n".join(f'    "{plan}": {_fmt(p)}' for plan, (p, _, _) in fits.items())
    return (f'"""The card model\'s fitted constants (engine/plan/card_model.py), written by\n'
            f'`python -m quant_serve.engine.plan.card_refit bench/results --write`; tests/engine/plan/test_card_model.py refits them\n'
            f'from the committed runs named in each `source`."""\n'
            f"from quant_serve.engine.plan.card_step import CardParams\n\n"
            f"FITTED = {{\n{body},\n}}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--write", action="store_true", help="rewrite engine/plan/card_params.py")
    args = ap.parse_args(argv)
    fits = fit_all(args.results)
    for plan, (p, report, obs) in fits.items():
        print(f"{plan}: rms {report['rms_error']:.1%}, worst {report['worst_error']:.1%} over {len(obs)} runs")
        steps = [o for o in obs if o.kind == "step"]
        for o, t in zip(steps, predict(steps, p)):
            print(f"  {t / o.seconds - 1:+6.1%}  {o.label}  ({o.source})")
        checks = observations(plan, args.results, fit=False)
        for o, t in zip(checks, predict(checks, p) if checks else []):
            print(f"  check {t / o.seconds - 1:+6.1%}  {o.label}  ({o.source})")
    if args.write:
        Path(__file__).with_name("card_params.py").write_text(params_source(fits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
