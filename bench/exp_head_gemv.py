"""Experiment (GPU): the batch-1 lm_head, [1, 3584] x [3584, 152064] fp16 (Qwen2.5-7B), cuBLAS (F.linear) against
kernels/gemv.py's kernel in several tilings, CUDA-graph timing (bench/kernels.graph_us) and triton's do_bench in
the same process, read bandwidth of the 1.09 GB head.

    PYTHONPATH=. python bench/exp_head_gemv.py --out bench/results/exp-head-gemv-h200.json
"""
import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import quant_serve.kernels.gemv as gemv_mod  # noqa: E402
from bench.kernels import graph_us  # noqa: E402

# (rows a program, columns a step, pipeline stages, warps); the first is kernels/gemv.py's
TILINGS = [(gemv_mod.BLOCK_N, gemv_mod.BLOCK_K, gemv_mod.STAGES, gemv_mod.WARPS), (8, 512, 1, 4), (16, 256, 3, 4),
           (4, 512, 3, 2), (32, 128, 4, 4), (16, 512, 2, 8)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/exp-head-gemv-h200.json")
    args = parser.parse_args()
    n, k = 152064, 3584
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    want = torch.nn.functional.linear(x, w)
    gbytes = n * k * 2 / 1e9
    rows = []

    def record(name, fn, check):
        graph, bench = graph_us([fn]), do_bench(fn, warmup=50, rep=400) * 1e3
        rows.append({"kernel": name, "graph_us": graph, "do_bench_us": bench, "graph_TBps": gbytes / graph * 1e3,
                     "max_abs_err": check})
        print(f"{name:32s} graph {graph:7.1f} us ({gbytes / graph * 1e3:.2f} TB/s)  do_bench {bench:7.1f} us")

    record("cuBLAS F.linear", lambda: torch.nn.functional.linear(x, w), 0.0)
    out = torch.empty(1, n, device="cuda", dtype=torch.float16)
    for bn, bk, st, nw in TILINGS:
        def run(bn=bn, bk=bk, st=st, nw=nw):
            gemv_mod._gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, n, w.stride(0), K=k, BLOCK_N=bn, BLOCK_K=bk,
                                                         STAGES=st, PDL=False, num_warps=nw)
        run()
        record(f"gemv {bn} rows x {bk} cols, {st} stages, {nw} warps", run,
               (out.float() - want.float()).abs().max().item())
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {"command": " ".join(sys.argv), "commit": git.stdout.strip() or "uncommitted",
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "shape": {"M": 1, "K": k, "N": n}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
