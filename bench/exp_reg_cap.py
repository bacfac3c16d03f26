"""Experiment (GPU): how the M = 1 fragment-layout matmul's programs fill the SMs, and ptxas register caps
(w4a16_mma max_regs) that make a grid resident at once. Qwen2.5-7B shapes, CUDA-graph timing over rotated weights
(as bench/kernels.py), every capped result checked against the exact dequantized reference.

    PYTHONPATH=. python bench/exp_reg_cap.py --out bench/results/exp-reg-cap-h200.json [--waves] [--caps] [--caps-m]

--waves: time per byte against N at a fixed chain of steps (programs an SM from 2 to 6); --caps: caps 56/48/40 at
M = 1 on the four layers, 64- and 32-column tiles; --caps-m: cap 56 on gate_up and down at M = 2..16.
"""
import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import GS, SHAPES, graph_us, nbytes, random_int4, rotated  # noqa: E402
from quant_serve.kernels.w4a16_frag import prepare_frag  # noqa: E402
from quant_serve.kernels.w4a16_mma import _w4a16_mma_kernel, w4a16_mma  # noqa: E402
from quant_serve.kernels.w4a16_ref import dequantize_w4  # noqa: E402

DEV = "cuda"


def compiled() -> list:
    """(registers, spills, shared bytes) of every compiled variant of the kernel so far."""
    return [(v.n_regs, v.n_spills, v.metadata.shared) for c in _w4a16_mma_kernel.device_caches.values()
            for v in c[0].values()]


def timed_rows(name: str, k: int, n: int, ms: list[int], cfgs: list[dict], caps: list[int]) -> list[dict]:
    raw = random_int4(k, n)
    fws = rotated(prepare_frag(*raw, GS), k, n)
    ref_w = dequantize_w4(*raw, GS, torch.float32)
    rows = []
    for m in ms:
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        ref = x.float() @ ref_w
        for cfg in cfgs:
            for cap in caps:
                before = len(compiled())
                row = {"shape": name, "k": k, "n": n, "m": m, "cfg": cfg, "cap": cap,
                       "programs": (n // cfg["block_n"]) * cfg["split_k"]}
                try:
                    y = w4a16_mma(x, fws[0], block_k=128, max_regs=cap, **cfg)
                    if not cfg.get("silu_mul"):
                        row["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                        assert row["rel_err"] < 2e-3, row
                    row["us"] = graph_us([lambda f=f: w4a16_mma(x, f, block_k=128, max_regs=cap, **cfg) for f in fws])
                    row["TBps"] = nbytes(m, k, n) / row["us"] / 1e6
                    after = compiled()
                    row["regs_spills_shared"] = after[-1] if len(after) > before else None
                except Exception as e:                    # a configuration that does not compile or launch
                    row["error"] = repr(e)[:300]
                print(json.dumps(row), flush=True)
                rows.append(row)
    del fws
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-reg-cap-h200.json")
    ap.add_argument("--waves", action="store_true")
    ap.add_argument("--caps", action="store_true")
    ap.add_argument("--caps-m", action="store_true")
    args = ap.parse_args()
    every = not (args.waves or args.caps or args.caps_m)
    out = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    swiglu = [dict(block_n=64, split_k=s, silu_mul=sl) for sl in (True, False) for s in (1, 2)]
    if every or args.waves:       # gate_up's K (28 steps a program), N for 2..6 programs an SM; down's and o's K
        out["waves_over_n"] = sum((timed_rows("gate_up-like", 3584, n, [1], swiglu, [0])
                                   for n in (16896, 33792, 35840, 37888, 42240, 50688)), [])
        out["waves_over_n"] += sum((timed_rows("down-like", 18944, n, [1], [dict(block_n=64, split_k=s) for s in
                                                                             (8, 12, 16, 24)], [0])
                                    for n in (2816, 3584, 4224, 8448)), [])
    if every or args.caps:
        cfgs = {"gate_up": swiglu + [dict(block_n=32, num_warps=2, split_k=s, silu_mul=True) for s in (1, 2)],
                "down": [dict(block_n=64, split_k=s) for s in (12, 16, 24)] +
                        [dict(block_n=32, num_warps=2, split_k=s) for s in (8, 12, 16)],
                "qkv": [dict(block_n=64, split_k=s) for s in (8, 16)] +
                       [dict(block_n=32, num_warps=2, split_k=s) for s in (4, 8)]}
        cfgs["o"] = cfgs["qkv"]
        out["register_caps_m1"] = sum((timed_rows(name, *SHAPES[name], [1], c, [0, 56, 48, 40])
                                       for name, c in cfgs.items()), [])
    if every or args.caps_m:
        out["register_caps_m2_16"] = (timed_rows("gate_up", *SHAPES["gate_up"], [2, 4, 8, 16], swiglu, [0, 56]) +
                                      timed_rows("down", *SHAPES["down"], [2, 4, 8, 16],
                                                 [dict(block_n=64, split_k=s) for s in (8, 16)], [0, 56]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
