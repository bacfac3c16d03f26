"""Experiment: weight loads in flight per warp in the mma.sync kernel (kernels/w4a16_mma.py, `depth` register sets
with the loop unrolled, against depth 1: one set rotated by a register move that waits for the step's own load), at
the dispatcher's configuration and its neighbours in split-K, M = 1..16 on the Qwen2.5-7B shapes, CUDA-graph timing
over rotated weight copies (as bench/kernels.py). Each configuration is checked against the exact reference first.

    PYTHONPATH=. timeout 300 python bench/exp_depth.py --out bench/results/exp-depth-h200.json
"""
import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import SHAPES, frag_layer, graph_us  # noqa: E402
from kernels.w4a16 import w4a16_forward  # noqa: E402
from kernels.w4a16_tuning import select_mma_config  # noqa: E402

DEV = "cuda"


def candidates(m: int, k: int, n: int, silu_mul: bool):
    """The rule's configuration, half and twice its splits, each at depth 1, 2 and 3."""
    rule = select_mma_config(m, k, n, silu_mul=silu_mul)
    splits = sorted({max(1, rule.split_k // 2), rule.split_k, min(16, rule.split_k * 2)})
    for split in splits:
        for depth in (1, 2, 3):
            yield dataclasses.replace(rule, split_k=split, depth=depth)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-depth-h200.json")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--budget-s", type=float, default=240, help="stop starting new points after this")
    args = ap.parse_args()
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "shapes": {}}
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    for name in SHAPES:
        k, n = SHAPES[name]
        ref_w, fws, dense, _ = frag_layer(k, n)
        rows = []
        for m in ms:
            if time.time() - t0 > args.budget_s:
                break
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            ref = x.float() @ ref_w
            row = {"m": m, "fp16_us": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                   "frag_us": graph_us([lambda f=f: w4a16_forward(x, f) for f in fws]), "cands": []}
            for cfg in candidates(m, k, n, False):
                entry = {"config": dataclasses.asdict(cfg)}
                try:
                    y = w4a16_forward(x, fws[0], config=cfg)
                    entry["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                    if entry["rel_err"] < 2e-3:
                        entry["us"] = graph_us([lambda f=f: w4a16_forward(x, f, config=cfg) for f in fws])
                except Exception as e:                        # a config that does not compile or launch
                    entry["error"] = repr(e)[:300]
                row["cands"].append(entry)
            by_depth = {}
            for e in row["cands"]:
                d = e["config"]["depth"]
                if "us" in e and e["us"] < by_depth.get(d, (float("inf"),))[0]:
                    by_depth[d] = (e["us"], e["config"]["split_k"])
            row["best_by_depth"] = {str(d): {"us": v[0], "split_k": v[1]} for d, v in sorted(by_depth.items())}
            bad = [e for e in row["cands"] if "us" not in e]
            print(f"{name:8s} M={m:3d} fp16 {row['fp16_us']:6.1f} frag {row['frag_us']:6.1f} "
                  + " ".join(f"d{d} {v[0]:6.1f} (s{v[1]})" for d, v in sorted(by_depth.items()))
                  + (f" bad {len(bad)} {bad[0]}"[:300] if bad else ""), flush=True)
            rows.append(row)
        out["shapes"][name] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    summary = {}
    for m in ms:
        rs = [r for rows in out["shapes"].values() for r in rows if r["m"] == m]
        if len(rs) < len(SHAPES):
            continue
        f = sum(r["fp16_us"] for r in rs)
        summary[f"m{m}"] = {"fp16_over_frag": f / sum(r["frag_us"] for r in rs)}
        for d in ("1", "2", "3"):
            if all(d in r["best_by_depth"] for r in rs):
                summary[f"m{m}"][f"fp16_over_depth{d}"] = f / sum(r["best_by_depth"][d]["us"] for r in rs)
    out["summary"] = summary
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
