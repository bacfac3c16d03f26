"""Experiment (GPU machine): how fast can a Triton program grid stream an INT4 weight matrix, by access pattern?

Question behind it (bench/NOTES-kernels.md entry 8): the M=1 GEMV streams gate_up at ~1.87 TB/s whatever its
pipelining, while cuBLAS reads the FP16 weight at ~3.8 TB/s. Is the row-strided tile (a program reads R runs of
BN bytes, N bytes apart) the limit, and would a tile-contiguous repack (each program's tiles one contiguous run)
lift it? Pure reads, no dequant: each program XOR-folds its tiles and stores one row of words.

    PYTHONPATH=. python bench/exp_read_layout.py --out bench/results/exp-read-layout-h200.json
"""
import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import graph_us  # noqa: E402

SHAPES = {"gate_up": (3584, 37888), "down": (18944, 3584), "qkv": (3584, 4608)}   # (K, N) of Qwen2.5-7B


@triton.jit
def _stream_kernel(w_ptr, out_ptr, rows_per_split, stride_pid, stride_row,
                   BNW: tl.constexpr, R: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, R)
    cols = tl.arange(0, BNW)
    base = w_ptr + pid.to(tl.int64) * stride_pid + (split * rows_per_split).to(tl.int64) * stride_row
    acc = tl.zeros([R, BNW], dtype=tl.int32)
    for k in tl.range(0, rows_per_split, R, num_stages=STAGES):
        acc ^= tl.load(base + (k + rows)[:, None] * stride_row + cols[None, :])
    folded = tl.xor_sum(acc, axis=0)
    tl.store(out_ptr + (split * tl.num_programs(0) + pid) * BNW + cols, folded)


def run_shape(name: str, k: int, n: int, budget_s: float) -> dict:
    rows, words = k // 2, n // 4                   # uint8 [K/2, N] seen as int32 [K/2, N/4]
    nbytes = rows * n
    copies = max(2, -(-200_000_000 // nbytes))
    bufs = [torch.randint(-2**31, 2**31 - 1, (rows * words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    out = torch.empty(64 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fp16 = [torch.randn(n, k, dtype=torch.float16, device="cuda") for _ in range(max(2, -(-200_000_000 // (n * k * 2))))]
    x = torch.randn(k, dtype=torch.float16, device="cuda")
    result = {"k": k, "n": n, "int4_bytes": nbytes, "candidates": []}
    result["fp16_cublas_mv_us"] = graph_us([lambda i=i: torch.mv(fp16[i], x) for i in range(len(fp16))])
    result["fp16_cublas_tb_s"] = n * k * 2 / result["fp16_cublas_mv_us"] / 1e6
    deadline = time.time() + budget_s
    for layout, bn, r, warps, stages, split in itertools.product(
            ("strided", "tile_contiguous"), (64, 128, 256, 512), (16, 32, 64), (4, 8), (1, 3), (1, 2, 4)):
        bnw = bn // 4
        if n % bn or rows % (r * split) or time.time() > deadline:
            continue
        programs = n // bn
        per_split = rows // split
        if layout == "strided":
            stride_pid, stride_row = bnw, words
        else:                                      # program p's [rows, bnw] block is one contiguous run
            stride_pid, stride_row = rows * bnw, bnw

        def launch(i, bnw=bnw, r=r, warps=warps, stages=stages, split=split, per_split=per_split,
                   programs=programs, stride_pid=stride_pid, stride_row=stride_row):
            _stream_kernel[(programs, split)](bufs[i], out, per_split, stride_pid, stride_row,
                                              BNW=bnw, R=r, STAGES=stages, num_warps=warps)
        try:
            us = graph_us([lambda i=i: launch(i) for i in range(copies)])   # rotating copies: past the L2
        except Exception as exc:                   # a config that cannot compile (registers, smem) is skipped
            result["candidates"].append({"layout": layout, "bn": bn, "r": r, "error": str(exc)[:200]})
            continue
        result["candidates"].append({"layout": layout, "bn_bytes": bn, "rows": r, "warps": warps, "stages": stages,
                                     "split": split, "programs": programs * split, "us": us,
                                     "tb_s": nbytes / us / 1e6})
    for layout in ("strided", "tile_contiguous"):
        ok = [c for c in result["candidates"] if c.get("layout") == layout and "us" in c]
        if ok:
            best = min(ok, key=lambda c: c["us"])
            result[f"best_{layout}"] = best
            print(f"{name} {layout}: best {best['us']:.1f} us = {best['tb_s']:.2f} TB/s {best}", flush=True)
    print(f"{name} fp16 cuBLAS mv {result['fp16_cublas_mv_us']:.1f} us = {result['fp16_cublas_tb_s']:.2f} TB/s",
          flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="gate_up,down,qkv")
    parser.add_argument("--budget-s", type=float, default=60, help="sweep time per shape")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "commit": commit or None,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "shapes": {}}
    for name in args.shapes.split(","):
        out["shapes"][name] = run_shape(name, *SHAPES[name], args.budget_s)
        torch.cuda.empty_cache()                   # the shape's buffers died with run_shape
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
