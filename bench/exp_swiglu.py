"""Experiment: gate_up with SwiGLU at M = 1 (Qwen2.5-7B shapes): the SwiGLU in the matmul's epilogue (64-column
tiles pairing gate and up columns, one split, x staged; or two splits, the split with the last ticket applying it)
against 128 x 2 splits with the SwiGLU reduce pass and 64 x 1 with the SwiGLU kernel; alone and as gate_up ->
down, CUDA-graph timed over rotated weights. Checks the fused output bit for bit against the unfused pair first.
--small-m: the same choice at M = 2..16 (one split with the SwiGLU epilogue against the rule's splits with the
reduce pass), each tile width and split count timed alone and as gate_up -> down with the down the dispatcher picks.
Run: PYTHONPATH=. python bench/exp_swiglu.py --out bench/results/exp-swiglu-h200.json"""
import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import GS, graph_us, random_int4, rotated  # noqa: E402
from quant_serve.kernels.norm_act import silu_and_mul  # noqa: E402
from quant_serve.kernels.w4a16_frag import prepare_frag  # noqa: E402
from quant_serve.kernels.w4a16_mma import w4a16_mma  # noqa: E402
from quant_serve.kernels.w4a16_tuning import select_mma_config  # noqa: E402

VARIANTS = {"epilogue_64x1": dict(block_n=64, block_k=128, split_k=1, num_warps=4),
            "reduce_pass_128x2": dict(block_n=128, block_k=128, split_k=2, num_warps=4, one_launch=False),
            "ticket_128x2": dict(block_n=128, block_k=128, split_k=2, num_warps=4, one_launch=True)}


def weights(k, n):
    return rotated(prepare_frag(*random_int4(k, n), GS), k, n)


def small_m(gate_up, down, hidden, inter, ms=(2, 3, 4, 8, 16)) -> dict:
    """gate_up + SwiGLU at M = 2..16: {M: {"rule": config, "<block_n>x<split>": us, ... "+down" chains}}."""
    res = {}
    for m in ms:
        x = torch.randn(m, hidden, dtype=torch.float16, device="cuda")
        rule = select_mma_config(m, hidden, 2 * inter, silu_mul=True)
        dn = select_mma_config(m, inter, hidden)
        dcfg = dict(block_n=dn.block_n, block_k=dn.block_k, split_k=dn.split_k, num_warps=dn.num_warps,
                    one_launch=dn.one_launch)
        row = {"rule": [rule.block_n, rule.split_k], "down": dcfg}
        ref = silu_and_mul(w4a16_mma(x, gate_up[0], block_n=64, split_k=1))
        for bn in (64, 128):
            for split in (1, 2, 4):
                cfg = dict(block_n=bn, block_k=128, split_k=split, num_warps=4, one_launch=False)
                got = w4a16_mma(x, gate_up[0], silu_mul=True, **cfg)
                row[f"{bn}x{split}_max_abs"] = (got.float() - ref.float()).abs().max().item()
                row[f"{bn}x{split}"] = graph_us([lambda f=f: w4a16_mma(x, f, silu_mul=True, **cfg) for f in gate_up])
                row[f"{bn}x{split}+down"] = graph_us([lambda f=f, d=d: w4a16_mma(
                    w4a16_mma(x, f, silu_mul=True, **cfg), d, **dcfg) for f, d in zip(gate_up, down)])
        res[m] = row
        print(m, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-swiglu-h200.json")
    ap.add_argument("--small-m", action="store_true", help="only the M = 2..16 comparison")
    args = ap.parse_args()
    hidden, inter = 3584, 18944
    gate_up, down = weights(hidden, 2 * inter), weights(inter, hidden)
    res = {"gpu": torch.cuda.get_device_name(), "checks": {}, "us": {}}
    if args.small_m:
        res["small_m"] = small_m(gate_up, down, hidden, inter)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
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
