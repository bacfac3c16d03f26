"""Experiment (GPU): the TMA-fed W4A16 kernel (kernels/w4a16_tma.py) across its tiles, against FP16 cuBLAS and the
dispatcher of the same tree, on the Qwen2.5-7B shapes; the sweep kernels/w4a16_tuning.select_tma_config is fitted to.
CUDA-graph timing over rotated weights (as bench/kernels.py); every candidate checked against the exact dequantized
reference first, and a correctness pass over odd shapes before any timing.

    PYTHONPATH=. python bench/exp_tma.py --out bench/results/exp-tma-h200.json [--ms 16,64,256] [--shapes qkv,o]

Candidates per (shape, M): 1 consumer warpgroup x 64 / 128 weight rows or 2 x 128 / 256, x tiles of 16..256 rows
(M rounded up, and 64 / 128 / 256 up to M), K splits 1-8 while the grid stays under four waves.
"""
import argparse
import json
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import SHAPES, checked_us, frag_layer, graph_us  # noqa: E402
from kernels.w4a16 import w4a16_forward  # noqa: E402
from kernels.w4a16_frag import prepare_frag  # noqa: E402
from kernels.w4a16_ref import dequantize_w4, pack_int4_rows  # noqa: E402
from kernels.w4a16_tma import w4a16_tma  # noqa: E402

DEV = "cuda"
# (K, N, M, group size, zero points, config): N past the tile, K padded to 64, odd step counts in a split
CHECKS = [(256, 256, 64, 128, True, {}), (512, 272, 100, 32, True, {"consumers": 1, "block_n": 64}),
          (384, 256, 300, -1, True, {}), (1024, 512, 256, 128, True, {"block_n": 256, "block_m": 128}),
          (1000, 256, 64, 0, False, {}), (1088, 512, 99, 64, True, {"split_k": 3}),
          (4096, 4096, 77, 64, False, {"consumers": 1, "split_k": 5, "block_n": 64, "stages": 6}),
          (2048, 512, 17, 128, True, {"block_m": 32})]


def check_one(k, n, m, group, zeros, cfg) -> dict:
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32, device=DEV)
    g = 1 if group <= 0 else k // group
    scales = (torch.rand(g, n, device=DEV) * 0.02 + 0.001).half()
    qz = pack_int4_rows(torch.randint(0, 16, (n, g), dtype=torch.int32, device=DEV)).t().contiguous() if zeros \
        else None
    gs = group if group > 0 else k
    fw = prepare_frag(pack_int4_rows(codes), scales, qz, gs)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    bias = torch.randn(n, dtype=torch.float16, device=DEV)
    ref = x.float() @ dequantize_w4(pack_int4_rows(codes), scales, qz, gs).float() + bias.float()
    err = ((w4a16_tma(x, fw, bias, **cfg).float() - ref).norm() / ref.norm()).item()
    return {"k": k, "n": n, "m": m, "group": group, "zeros": zeros, "config": cfg, "rel_err": err}


def candidates(m: int, n: int) -> list[dict]:
    bms = sorted({min(256, max(16, 1 << (m - 1).bit_length()))} | {b for b in (64, 128, 256) if b <= max(64, m)})
    out = []
    for cons, bns in ((2, (128, 256)), (1, (64, 128))):
        for bn in bns:
            for bm in bms:
                if bm > 128 * cons or (bn // cons == 128 and bm == 256):
                    continue
                tiles = -(-n // bn) * -(-m // bm)
                for split in (1, 2, 4, 8):
                    if split == 1 or (tiles < 132 * (3 - cons) and tiles * split <= 4 * 132):
                        out.append(dict(consumers=cons, block_n=bn, block_m=bm, split_k=split))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-tma-h200.json")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    start = time.time()
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "checks": [check_one(*c) for c in CHECKS], "points": []}
    bad = [c for c in result["checks"] if not c["rel_err"] < 2e-3]
    print(f"checks: {len(bad)} bad of {len(CHECKS)}", flush=True)
    if bad:
        raise SystemExit(json.dumps(bad))
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        ref_w, fws, dense, _ = frag_layer(k, n)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            ref = x.float() @ ref_w
            point = {"shape": name, "m": m, "fp16_us": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                     "dispatcher_us": graph_us([lambda f=f: w4a16_forward(x, f) for f in fws]),
                     "tma": [checked_us(lambda f, **c: w4a16_tma(x, f, **c), fws, ref, c) for c in candidates(m, n)]}
            best = min((c for c in point["tma"] if "us" in c), key=lambda c: c["us"])
            print(f"{name} M={m}: fp16 {point['fp16_us']:.1f} dispatcher {point['dispatcher_us']:.1f} "
                  f"tma best {best['us']:.1f} {best['config']}", flush=True)
            result["points"].append(point)
        del fws, dense
        torch.cuda.empty_cache()
    result["wall_s"] = time.time() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
