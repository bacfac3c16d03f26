"""Experiment: the warp-specialized Hopper W4A16 kernel (kernels/w4a16_ws.py) against FP16 cuBLAS and the
fragment-layout dispatcher ("frag", today's path) on the Qwen2.5-7B shapes, CUDA-graph timing over rotated weight
copies (as bench/kernels.py). Every configuration is checked against the exact dequantized reference first.
Run it under `timeout`: a pipeline that deadlocks hangs the process.

    PYTHONPATH=. timeout 500 python bench/exp_ws.py --out bench/results/exp-ws-h200.json
"""
import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import SHAPES, checked_us, frag_layer, graph_us  # noqa: E402
from kernels.w4a16 import w4a16_forward  # noqa: E402
from kernels.w4a16_ws import w4a16_ws  # noqa: E402

DEV = "cuda"


def candidates(m: int):
    """Tiles, ring depth and K splits around the kernel's defaults; more splits where M leaves the grid small."""
    block_ms = [None] if m < 128 else [64, 128]
    splits = (1, 2, 4) if m <= 128 else (1,)
    for bn, bk, stages, split, bm in itertools.product((64, 128), (64, 128), (3, 4), splits, block_ms):
        if bk == 128 and (bm or 64) == 128 and bn == 128:
            continue                             # over 192 KB of ring: spills and one program an SM
        yield dict(block_n=bn, block_k=bk, stages=stages, split_k=split, block_m=bm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-ws-h200.json")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=60, help="sweep time per shape")
    args = ap.parse_args()
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "shapes": {}}
    ms = [int(v) for v in args.ms.split(",")]
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ref_w, fws, dense, _ = frag_layer(k, n)
        rows, t0 = [], time.time()
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            ref = x.float() @ ref_w
            row = {"m": m, "fp16_us": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                   "frag_us": graph_us([lambda f=f: w4a16_forward(x, f) for f in fws]), "ws": []}
            for cfg in candidates(m):
                if time.time() - t0 > args.budget_s * (ms.index(m) + 1) / len(ms):
                    break
                row["ws"].append(checked_us(lambda f, **c: w4a16_ws(x, f, **c), fws, ref, cfg))
            ok = [e for e in row["ws"] if "us" in e]
            if ok:
                best = min(ok, key=lambda e: e["us"])
                row["ws_best_us"], row["ws_best_config"] = best["us"], best["config"]
            bad = [e for e in row["ws"] if "us" not in e]
            print(f"{name:8s} M={m:5d} fp16 {row['fp16_us']:8.1f} frag {row['frag_us']:8.1f} "
                  f"ws {row.get('ws_best_us', float('nan')):8.1f} {row.get('ws_best_config')} bad {len(bad)} "
                  f"{bad[0] if bad else ''}"[:400], flush=True)
            rows.append(row)
        out["shapes"][name] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))          # each shape as it lands
    summary = {}
    for m in ms:
        rs = [r for rows in out["shapes"].values() for r in rows if r["m"] == m]
        f = sum(r["fp16_us"] for r in rs)
        summary[f"m{m}"] = {"fp16_over_frag": f / sum(r["frag_us"] for r in rs),
                            "fp16_over_ws": f / sum(r.get("ws_best_us", float("inf")) for r in rs),
                            "worst_ws_over_fp16": max(r.get("ws_best_us", float("inf")) / r["fp16_us"] for r in rs)}
    out["summary"] = summary
    print(json.dumps(summary, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
