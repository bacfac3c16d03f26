"""Experiment (GPU): is a reading of bench/kernels.py's graph timer stable? One layer's FP16 cuBLAS and our
dispatcher (on the weights as bench/kernels.py and as bench/exp_tma.py build them), graph-timed in turn, two rounds
before and two after bench_linear's own timing of the same points, with the SM clock and power read between rounds.

    PYTHONPATH=. python bench/exp_timing_ab.py gate_up 64,1024 [--out bench/results/exp-timing-ab-h200.json]
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

import bench.kernels as bk  # noqa: E402
from bench.kernels import DEV, GS, SHAPES, copies, frag_layer, graph_us, random_int4, rotated  # noqa: E402
from quant_serve.kernels.w4a16 import prepare_kernel_weights, w4a16_forward  # noqa: E402


def smi() -> str:
    """SM clock, power, temperature and throttle reasons, read (never set)."""
    q = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("ms")
    ap.add_argument("--out", default="bench/results/exp-timing-ab-h200.json")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    k, n = SHAPES[args.shape]
    qw, sc, qz = random_int4(k, n)
    ws = rotated(prepare_kernel_weights(qw, sc, qz, GS), k, n)          # as bench/kernels.py builds them
    dense = [torch.randn(k, n, dtype=torch.float16, device=DEV) * 0.02 for _ in range(copies(k * n * 2))]
    _, fws, dense2, _ = frag_layer(k, n)                                # as bench/exp_tma.py builds them
    out = {"rows": []}

    def rounds(tag):
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            for rnd in range(2):
                r = {"tag": tag, "shape": args.shape, "m": m, "round": rnd,
                     "fp16": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                     "ours_kernelspy_w": graph_us([lambda w=w: w4a16_forward(x, w) for w in ws]),
                     "ours_exptma_w": graph_us([lambda w=w: w4a16_forward(x, w) for w in fws]),
                     "fp16_2": graph_us([lambda d=d: torch.mm(x, d) for d in dense2]),
                     "ours_kernelspy_w_again": graph_us([lambda w=w: w4a16_forward(x, w) for w in ws]),
                     "smi": smi()}
                print(json.dumps({a: (round(b, 1) if isinstance(b, float) else b) for a, b in r.items()}), flush=True)
                out["rows"].append(r)
    rounds("before")
    bk.MS[:] = ms
    t = time.time()
    out["bench_linear"] = bk.bench_linear(args.shape, k, n, None, False, 0, print)
    print("bench_linear s", time.time() - t, smi(), flush=True)
    rounds("after")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
