"""Experiment: how many K splits and which register cap the mma.sync kernel (kernels/w4a16_mma.py) should run at
M = 1..16 on the Qwen2.5-7B shapes. The rule's splits were powers of two, of which a kernel of `iters` K steps only
sees the distinct step counts per split (cdiv): down at M = 16 ran 8 splits of 19 steps, 448 programs, where 5
programs an SM (86 registers) would hold 660. Candidates: every distinct split count whose grid stays under ~2
waves, times each register cap; the rule's config and each point's best three are then re-timed in turn, three
rounds (bench/kernels.py alternating_us), medians kept. Every candidate is checked against the exact dequantized
reference before it is timed.
Run: PYTHONPATH=. python bench/exp_mma_splits.py --out bench/results/exp-mma-splits-h200.json"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]  # not bench/kernels.py

import torch  # noqa: E402

from bench.kernels import SHAPES, alternating_us, checked_us, frag_layer  # noqa: E402
from quant_serve.kernels.w4a16 import w4a16_forward  # noqa: E402
from quant_serve.kernels.w4a16_mma import w4a16_mma  # noqa: E402
from quant_serve.kernels.w4a16_tuning import select_mma_config  # noqa: E402

DEV = "cuda"


def split_counts(iters: int, tiles: int, min_programs: int, max_programs: int) -> list[int]:
    """The distinct split counts cdiv(iters, per) over steps-per-split `per`, largest first, whose grid has
    min_programs..max_programs programs (splits are what the kernel runs: w4a16_mma takes split_k as an upper
    bound); one split always where the tiles alone pass min_programs."""
    counts = {-(-iters // per) for per in range(1, iters + 1)}
    return sorted((s for s in counts
                   if min_programs <= tiles * s <= max_programs or (s == 1 and tiles >= min_programs)), reverse=True)


def candidates(m: int, k: int, n: int, caps: list[int], min_programs: int, max_programs: int,
               block_ks: tuple[int, ...] = (128,)) -> list[dict]:
    """Every split count with every register cap, 64-column tiles of 4 warps, K steps of each of block_ks rows."""
    tiles = -(-n // 64)
    return [dict(block_n=64, block_k=bk, split_k=s, num_warps=4, one_launch=True, max_regs=cap)
            for bk in block_ks for s in split_counts(k // bk, tiles, min_programs, max_programs) for cap in caps]


def rule_points(shapes: str, ms: str):
    """For each shape and M (comma-separated): (name, (K, N), M, x [M, K], the exact reference [M, N] fp32, the
    rotated fragment-layout weights, the rotated FP16 weights, the rule's w4a16_mma keywords)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in shapes.split(","):
        k, n = SHAPES[name]
        ref_w, fws, dense, _ = frag_layer(k, n)
        for m in [int(v) for v in ms.split(",")]:
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            rule = select_mma_config(m, k, n, sms=sms)
            yield name, (k, n), m, x, x.float() @ ref_w, fws, dense, dict(
                block_n=rule.block_n, block_k=rule.block_k, split_k=rule.split_k, num_warps=rule.num_warps,
                one_launch=rule.one_launch, max_regs=rule.max_regs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-mma-splits-h200.json")
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--caps", default="0,72,80", help="register caps a thread tried at M > 1 (0: none)")
    ap.add_argument("--block-ks", default="128", help="K rows a step (128, 256)")
    ap.add_argument("--kw", default="", help="name=int,...: w4a16_mma keywords tried beside each candidate and the "
                    "rule (e.g. x_bufs3=1)")
    ap.add_argument("--min-programs", type=int, default=200)
    ap.add_argument("--max-programs", type=int, default=1400)
    ap.add_argument("--confirm", type=int, default=3, help="best candidates re-timed in turn with the rule's")
    args = ap.parse_args()
    t0 = time.time()
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "points": []}
    for name, (k, n), m, x, ref, fws, dense, rule_cfg in rule_points(args.shapes, args.ms):
        caps = [0] if m == 1 else [int(c) for c in args.caps.split(",")]
        cands = candidates(m, k, n, caps, args.min_programs, args.max_programs,
                           tuple(int(v) for v in args.block_ks.split(",")))
        kw = {key: int(v) for key, v in (item.split("=") for item in filter(None, args.kw.split(",")))}
        if kw and m > 1:
            cands += [dict(c, **kw) for c in cands]
        swept = [checked_us(lambda f, **c: w4a16_mma(x, f, **c), fws, ref, c) for c in cands]
        ok = sorted((e for e in swept if "us" in e), key=lambda e: e["us"])
        calls = {"fp16": [lambda d=d: torch.mm(x, d) for d in dense],
                 "dispatcher": [lambda f=f: w4a16_forward(x, f) for f in fws],
                 "rule": [lambda f=f: w4a16_mma(x, f, **rule_cfg) for f in fws]}
        if kw and m > 1:
            calls["rule+kw"] = [lambda f=f: w4a16_mma(x, f, **rule_cfg, **kw) for f in fws]
        for i, e in enumerate(ok[:args.confirm]):
            calls[f"cand{i}"] = [lambda f=f, c=e["config"]: w4a16_mma(x, f, **c) for f in fws]
        runs = alternating_us(calls)
        med = {key: median(v) for key, v in runs.items()}
        point = {"shape": name, "m": m, "rule": rule_cfg, "sweep": swept, "confirm_runs_us": runs,
                 "confirm_median_us": med,
                 "confirm_configs": {f"cand{i}": e["config"] for i, e in enumerate(ok[:args.confirm])}}
        out["points"].append(point)
        best = min((key for key in med if key.startswith("cand")), key=med.get, default=None)
        print(f"{name:8s} M={m:3d} fp16 {med['fp16']:6.2f} disp {med['dispatcher']:6.2f} rule {med['rule']:6.2f} "
              f"rule+kw {med.get('rule+kw', float('nan')):6.2f} "
              f"best {med.get(best, float('nan')):6.2f} {point['confirm_configs'].get(best)} "
              f"({len(ok)}/{len(cands)} ok, {time.time() - t0:.0f} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))         # each point as it lands (a run may be cut)
    out["wall_s"] = time.time() - t0
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
