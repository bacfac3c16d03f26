"""Experiment (GPU): the M = 1 fragment-layout matmul with one CTA barrier after the x staging (x_once) against
Triton's barrier in every step, per layer, in one process: the two variants timed in turn, three rounds each, as
bench/kernels.py times (CUDA-graph replay over rotated weights), each checked against the exact reference first.

    PYTHONPATH=. python bench/exp_x_once.py --out bench/results/exp-x-once-h200.json
"""
import argparse
import json
import sys
from pathlib import Path
from statistics import median

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import SHAPES, alternating_us, frag_layer  # noqa: E402
from quant_serve.kernels.w4a16 import frag_config, w4a16_forward  # noqa: E402
from quant_serve.kernels.w4a16_mma import w4a16_mma  # noqa: E402

DEV = "cuda"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-x-once-h200.json")
    args = ap.parse_args()
    out = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "layers": {}}
    for name, (k, n) in SHAPES.items():
        ref_w, fws, _, _ = frag_layer(k, n)
        x = torch.randn(1, k, dtype=torch.float16, device=DEV)
        ref = x.float() @ ref_w
        cfg = frag_config(1, k, n, x.device)
        kw = dict(block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps,
                  one_launch=cfg.one_launch, max_regs=cfg.max_regs)
        calls = {"dispatcher": [lambda f=f: w4a16_forward(x, f) for f in fws]}
        for once in (True, False):
            y = w4a16_mma(x, fws[0], x_once=once, **kw)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-3, (name, once, err)
            calls[f"x_once={once}"] = [lambda f=f, once=once: w4a16_mma(x, f, x_once=once, **kw) for f in fws]
        runs = alternating_us(calls)
        out["layers"][name] = {"config": kw, "runs_us": runs, "median_us": {c: median(v) for c, v in runs.items()}}
        print(name, {c: round(median(v), 2) for c, v in runs.items()}, flush=True)
        del fws
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
