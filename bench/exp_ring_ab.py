"""Experiment: this tree's mma.sync matmul (kernels/w4a16_mma.py) against an older kernels/w4a16_mma.py loaded from
a file (--old: e.g. `git show <commit>:kernels/w4a16_mma.py`; it must import from this tree's other modules), in one
process: the rule's configuration for both, on the Qwen2.5-7B shapes at M = 2..16, FP16 beside them, timed in turn
three rounds (bench/kernels.py alternating_us), medians kept. Both are checked against the exact dequantized
reference first. bench/results/exp-ring-ab-h200.json: b3818fb's loop (load pointers carried from step to step,
not kept) against 18488c3's.
Run: PYTHONPATH=. python bench/exp_ring_ab.py --old /path/old_w4a16_mma.py --out bench/results/exp-ring-ab-h200.json"""
import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # not bench/kernels.py

import torch  # noqa: E402

from bench.exp_mma_splits import rule_points  # noqa: E402
from bench.kernels import SHAPES, alternating_us  # noqa: E402
from quant_serve.kernels.w4a16_mma import w4a16_mma  # noqa: E402

DEV = "cuda"


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="an older kernels/w4a16_mma.py")
    ap.add_argument("--out", default="bench/results/exp-ring-ab-h200.json")
    ap.add_argument("--ms", default="2,4,8,12,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    old = load_module(args.old, "old_w4a16_mma").w4a16_mma
    t0 = time.time()
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "points": []}
    sums = {}
    for name, _, m, x, ref, fws, dense, cfg in rule_points(args.shapes, args.ms):
        err = {key: ((fn(x, fws[0], **cfg).float() - ref).norm() / ref.norm()).item()
               for key, fn in (("old", old), ("new", w4a16_mma))}
        calls = {"fp16": [lambda d=d: torch.mm(x, d) for d in dense]}
        calls.update({key: [lambda f=f, fn=fn: fn(x, f, **cfg) for f in fws]
                      for key, fn in (("old", old), ("new", w4a16_mma)) if err[key] < 2e-3})
        runs = alternating_us(calls)
        med = {key: median(v) for key, v in runs.items()}
        out["points"].append({"shape": name, "m": m, "config": cfg, "rel_err": err, "runs_us": runs,
                              "median_us": med})
        for key, v in med.items():
            sums.setdefault(m, {}).setdefault(key, 0.0)
            sums[m][key] += v
        print(f"{name:8s} M={m:3d} fp16 {med['fp16']:6.2f} old {med.get('old', float('nan')):6.2f} "
              f"new {med.get('new', float('nan')):6.2f} err {err['old']:.1e}/{err['new']:.1e} "
              f"({time.time() - t0:.0f} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))         # each point as it lands (a run may be cut)
    out["sums_us"] = sums
    out["wall_s"] = time.time() - t0
    for m, s in sums.items():
        print(f"M={m:3d} sum: fp16 {s['fp16']:.2f} old {s.get('old', 0):.2f} new {s.get('new', 0):.2f}")
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
