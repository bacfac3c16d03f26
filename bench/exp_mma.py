"""Experiment: the Gluon fragment-layout W4A16 kernel (kernels/w4a16_mma.py; mma.sync up to M = 64, the opt-in
wgmma variant at every M) against FP16 cuBLAS, the row-layout dispatcher ("rows") and the fragment-layout dispatcher
("frag"), Qwen2.5-7B shapes, CUDA-graph timing over rotated weight copies (as bench/kernels.py). Every configuration
is checked against the exact dequantized reference before it is timed.
Run: PYTHONPATH=. python bench/exp_mma.py --out bench/results/exp-mma-h200.json"""
import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # not bench/kernels.py

import torch  # noqa: E402

from bench.kernels import SHAPES, GS, checked_us, frag_layer, graph_us, nbytes, rotated  # noqa: E402
from quant_serve.kernels.w4a16 import prepare_w4a16, w4a16_forward  # noqa: E402
from quant_serve.kernels.w4a16_mma import w4a16_mma  # noqa: E402

DEV = "cuda"


def configs(m, wgmma, focus=False, variant_sweep=False):
    """Candidates; focus: mma.sync only around the fitted rule (64/128 columns, 4 warps, split 1-16, one launch);
    variant_sweep: the same around the rule with and without x staged in shared memory at M = 1 (the flag was
    --fence-sweep in the commands of exp-mma-variants-h200.json, whose commit swept a load-order fence, scales after
    the MMA and a compute-only knob instead, and of exp-mma-xstaged-h200.json)."""
    if variant_sweep:
        if wgmma:
            return
        for (bn, bk), split, staged in itertools.product(((64, 128), (128, 128), (64, 256)), (1, 2, 4, 8, 16),
                                                         (False, True)):
            yield dict(block_n=bn, block_k=bk, num_warps=4, split_k=split, one_launch=True, x_staged=staged)
        return
    if wgmma:                 # tiles that compile without spills; the one-launch epilogue never won (exp-mma-wgmma)
        tiles = ([(64, 4, 128), (128, 4, 128), (64, 4, 64), (128, 8, 64)] if m <= 32 else
                 [(64, 4, 128), (128, 8, 128), (128, 8, 64)] if m <= 64 else [(128, 8, 128), (128, 8, 64)])
        tiles += [(256, 8, 128), (256, 8, 64)] if 32 < m <= 64 else [(256, 8, 64)] if m > 64 else []
        ones, splits = (False,), (1, 2, 4, 8)
        for (bn, nw, bk), split, one in itertools.product(tiles, splits, ones):
            if split > 1 or one or len(ones) == 1:
                yield dict(block_n=bn, block_k=bk, num_warps=nw, split_k=split, one_launch=one, wgmma=True)
        return
    elif focus:
        shapes, bks, ones, splits = [(64, 4), (128, 4)], (128, 256), (True,), (1, 2, 4, 8, 16)
    else:
        shapes = [(64, 4), (128, 4), (128, 8)] + ([(256, 4), (256, 8)] if m > 1 else [])
        bks, ones, splits = (128, 256), (True, False), (1, 2, 4, 8)
    for (bn, nw), bk, split, one in itertools.product(shapes, bks, splits, ones):
        if split > 1 or one or len(ones) == 1:
            yield dict(block_n=bn, block_k=bk, num_warps=nw, split_k=split, one_launch=one, wgmma=wgmma)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-mma-h200.json")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,1024")
    ap.add_argument("--sweep-ms", default="1,16,64,128,256")
    ap.add_argument("--budget-s", type=float, default=100, help="sweep time per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--wgmma-only", action="store_true", help="sweep only the wgmma variant above M = 16")
    ap.add_argument("--focus", action="store_true", help="mma.sync candidates only around the fitted rule")
    ap.add_argument("--variant-sweep", action="store_true",
                    help="the rule's neighbourhood with and without x staged in shared memory")
    args = ap.parse_args()
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    sweep_ms = {int(v) for v in args.sweep_ms.split(",")}
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "shapes": {}}
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ref_w, fws, dense, raw = frag_layer(k, n)
        wss = rotated(prepare_w4a16(*raw, GS), k, n)
        rows = []
        best_cfg = None
        t0 = time.time()
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            ref = x.float() @ ref_w
            row = {"m": m, "fp16_us": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                   "ours_us": graph_us([lambda w=w: w4a16_forward(x, w) for w in wss]),      # row layout
                   "frag_us": graph_us([lambda f=f: w4a16_forward(x, f) for f in fws])}      # dispatcher, fragments
            sweep = (m in sweep_ms or best_cfg is None) and time.time() - t0 < args.budget_s
            mma_sync = m <= 64 and not (args.wgmma_only and m > 16)
            sync_cands = list(configs(m, False, args.focus, args.variant_sweep)) if mma_sync else []
            wg_cands = list(configs(m, True, variant_sweep=args.variant_sweep)) if m > 1 else []
            cands = sync_cands + wg_cands if sweep else [best_cfg]
            row["mma"] = [checked_us(lambda f, **c: w4a16_mma(x, f, **c), fws, ref, cfg) for cfg in cands]
            ok = [e for e in row["mma"] if "us" in e]
            if ok:
                best = min(ok, key=lambda e: e["us"])
                row["mma_best_us"], row["mma_best_config"] = best["us"], best["config"]
                if m in sweep_ms:
                    best_cfg = best["config"]
                row["mma_TBps"] = nbytes(m, k, n) / best["us"] / 1e6
            variants = {}
            for e in ok:
                key = "x_staged" if e["config"].get("x_staged", True) else "base"
                if key not in variants or e["us"] < variants[key]["us"]:
                    variants[key] = {"us": e["us"], "config": e["config"]}
            row["variant_best"] = variants
            print("   ", {k: round(v["us"], 2) for k, v in variants.items()}, flush=True)
            errs = [e for e in row["mma"] if "us" not in e]
            print(f"{name:8s} M={m:4d} fp16 {row['fp16_us']:7.1f} rows {row['ours_us']:7.1f} "
                  f"frag {row['frag_us']:7.1f} "
                  f"mma {row.get('mma_best_us', float('nan')):7.1f} {row.get('mma_best_config')} "
                  f"bad/err {len(errs)} {errs[0] if errs else ''}"[:400], flush=True)
            rows.append(row)
        out["shapes"][name] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))          # each shape as it lands (a run may be cut)
    summ = {}
    for m in ms:
        f = sum(r["fp16_us"] for rs in out["shapes"].values() for r in rs if r["m"] == m)
        o = sum(r["ours_us"] for rs in out["shapes"].values() for r in rs if r["m"] == m)
        b = sum(r.get("mma_best_us", float("inf")) for rs in out["shapes"].values() for r in rs if r["m"] == m)
        summ[f"m{m}"] = {"fp16_over_ours": f / o, "fp16_over_mma": f / b}
        keys = {k for rs in out["shapes"].values() for r in rs if r["m"] == m for k in r.get("variant_best", {})}
        for key in sorted(keys):
            v = sum(r["variant_best"].get(key, {"us": float("inf")})["us"] for rs in out["shapes"].values()
                    for r in rs if r["m"] == m)
            summ[f"m{m}"][f"fp16_over_{key}"] = f / v
    out["summary"] = summ
    print(json.dumps(summ, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
