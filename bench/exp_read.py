"""Experiment: how fast can a program grid shaped like the M=1 W4A16 kernel stream its weight words, with no
dequant or MMA? Same grid and word addresses as kernels/w4a16_mma.py (fragment layout), DEPTH steps of loads in
flight per program, against the same bytes read as one contiguous run per program step, and torch's copy.
Run: PYTHONPATH=. python bench/exp_read.py --out bench/results/exp-read-h200.json"""
import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from bench.kernels import copies, graph_us  # noqa: E402
from quant_serve.kernels.w4a16_tiles import _tile_words, word_layout  # noqa: E402


@gluon.jit
def _read_kernel(w_ptr, out_ptr, KP, iters_per_split, DEPTH: gl.constexpr, CONTIG: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    offs, w_mask, n_lo, n_hi, k_in = _tile_words(pid_n, BLOCK_N * gl.num_programs(0), KP, 1 << 30, True, BLOCK_N,
                                                 BLOCK_K, num_warps)
    WL: gl.constexpr = word_layout(num_warps, BLOCK_N // (16 * num_warps), BLOCK_K // 64)
    if CONTIG:
        # the same tile's words as one contiguous run per step: program (n, k-split) owns a contiguous stream
        STEP: gl.constexpr = BLOCK_N * BLOCK_K // 8
        lin = gl.arange(0, STEP, layout=gl.BlockedLayout([4], [32], [num_warps], [0]))
        base = (pid_n * (KP // BLOCK_K) + pid_k * iters_per_split) * STEP
        acc = gl.zeros([STEP], gl.int32, gl.BlockedLayout([4], [32], [num_warps], [0]))
    else:
        acc = gl.zeros([BLOCK_N // 2, BLOCK_K // 64, 4, 4], gl.int32, WL)
    it0 = pid_k * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, KP // BLOCK_K)
    for it in range(it0, it1, DEPTH):
        for d in gl.static_range(DEPTH):
            st = gl.minimum(it + d, it1 - 1)
            if CONTIG:
                acc ^= gl.load(w_ptr + base + (st - it0) * STEP + lin)
            else:
                acc ^= gl.load(w_ptr + offs + st * BLOCK_K * 2)
    total = gl.sum(gl.reshape(acc, [BLOCK_N * BLOCK_K // 8]), axis=0)
    gl.store(out_ptr + pid_n * gl.num_programs(1) + pid_k, total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-read-h200.json")
    args = ap.parse_args()
    # (name, K, N, BLOCK_N, BLOCK_K, split)
    cases = [("gate_up", 3584, 37888, 128, 128, 2), ("gate_up", 3584, 37888, 64, 128, 1),
             ("gate_up", 3584, 37888, 128, 128, 1), ("gate_up", 3584, 37888, 64, 128, 4),
             ("down", 18944, 3584, 64, 128, 16), ("down", 18944, 3584, 64, 128, 4),
             ("qkv", 3584, 4608, 64, 128, 8)]
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    big = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    res["copy_TBps"] = 2 * 2 ** 29 / graph_us([lambda: big[: 2 ** 29].copy_(big[2 ** 29:])]) / 1e6
    print("copy TB/s", round(res["copy_TBps"], 3), flush=True)
    for name, k, n, bn, bk, split in cases:
        kp = k
        nbytes = n * kp // 2
        ws = [torch.randint(-2 ** 31, 2 ** 31, (n // 16, kp * 2), dtype=torch.int32, device="cuda")
              for _ in range(copies(nbytes))]
        iters = kp // bk
        per = triton.cdiv(iters, split)
        grid = (n // bn, triton.cdiv(iters, per))
        out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device="cuda")
        for contig in (False, True):
            for depth in (1, 2, 4, 8):
                def run(w):
                    _read_kernel[grid](w, out, kp, per, DEPTH=depth, CONTIG=contig, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=4)
                us = graph_us([lambda w=w: run(w) for w in ws])
                row = dict(name=name, k=k, n=n, block_n=bn, block_k=bk, split=split, programs=grid[0] * grid[1],
                           contig=contig, depth=depth, us=us, TBps=nbytes / us / 1e6)
                res["rows"].append(row)
                print(row, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
