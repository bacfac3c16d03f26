"""Experiment: gate_up with SwiGLU at M = 1 (Qwen2.5-7B shapes): the SwiGLU in the matmul's epilogue (64-column
tiles pairing gate and up columns, one split, x staged) against 128 x 2 splits with the SwiGLU reduce pass and
64 x 1 with the SwiGLU kernel; alone and as gate_up -> down, CUDA-graph timed over rotated weights. Checks the
fused output bit for bit against the unfused pair first.
Run: PYTHONPATH=. python bench/exp_swiglu.py --out bench/results/exp-swiglu-h200.json"""
import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import GS, graph_us, random_int4, rotated  # noqa: E402
from kernels.norm_act import silu_and_mul  # noqa: E402
from kernels.w4a16_frag import prepare_frag  # noqa: E402
from kernels.w4a16_mma import w4a16_mma  # noqa: E402

VARIANTS = {"epilogue_64x1": dict(block_n=64, block_k=128, split_k=1, num_warps=4),
            "reduce_pass_128x2": dict(block_n=128, block_k=128, split_k=2, num_warps=4, one_launch=False)}


def weights(k, n):
    return rotated(prepare_frag(*random_int4(k, n), GS), k, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-swiglu-h200.json")
    args = ap.parse_args()
    hidden, inter = 3584, 18944
    gate_up, down = weights(hidden, 2 * inter), weights(inter, hidden)
    res = {"gpu": torch.cuda.get_device_name(), "checks": {}, "us": {}}
    x = torch.randn(1, hidden, dtype=torch.float16, device="cuda")
    fused = w4a16_mma(x, gate_up[0], silu_mul=True, **VARIANTS["epilogue_64x1"])
    unfused = silu_and_mul(w4a16_mma(x, gate_up[0], **VARIANTS["epilogue_64x1"]))
    res["checks"]["m1_bitwise"] = bool(torch.equal(fused, unfused))
    res["checks"]["m1_vs_reduce_pass_max_abs"] = (fused.float() - w4a16_mma(
        x, gate_up[0], silu_mul=True, **VARIANTS["reduce_pass_128x2"]).float()).abs().max().item()
    print(res["checks"], flush=True)
    for name, cfg in VARIANTS.items():
        res["us"][name] = graph_us([lambda f=f: w4a16_mma(x, f, silu_mul=True, **cfg) for f in gate_up])
        res["us"][name + "+down"] = graph_us([lambda f=f, d=d: w4a16_mma(w4a16_mma(x, f, silu_mul=True, **cfg), d,
                                                                         block_n=64, split_k=16)
                                              for f, d in zip(gate_up, down)])
    cfg = VARIANTS["epilogue_64x1"]
    res["us"]["kernel_64x1"] = graph_us([lambda f=f: silu_and_mul(w4a16_mma(x, f, **cfg)) for f in gate_up])
    res["us"]["kernel_64x1+down"] = graph_us([lambda f=f, d=d: w4a16_mma(silu_and_mul(w4a16_mma(x, f, **cfg)), d,
                                                                         block_n=64, split_k=16)
                                              for f, d in zip(gate_up, down)])
    print(res["us"], flush=True)
    for m, bn in ((16, 64), (3, 128)):
        xm = torch.randn(m, 512, dtype=torch.float16, device="cuda")
        small = weights(512, 512)[0]
        res["checks"][f"m{m}_bn{bn}_bitwise"] = bool(torch.equal(
            w4a16_mma(xm, small, silu_mul=True, block_n=bn, split_k=1),
            silu_and_mul(w4a16_mma(xm, small, block_n=bn, split_k=1))))
    print(res["checks"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
