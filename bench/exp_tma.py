"""Experiment (GPU): the TMA-fed W4A16 kernel (kernels/w4a16_tma.py) across its tiles, against FP16 cuBLAS and the
dispatcher of the same tree, on the Qwen2.5-7B shapes; the sweep kernels/w4a16_tuning.select_tma_config is fitted to.
CUDA-graph timing over rotated weights (as bench/kernels.py); every candidate checked against the exact dequantized
reference first, and a correctness pass over odd shapes before any timing.

    PYTHONPATH=. python bench/exp_tma.py --out bench/results/exp-tma-sk-h200.json [--ms 16,64,256] [--shapes qkv,o]
        [--stages 4,8,12] [--extra gate_up_a=3584:33792]

Candidates per (shape, M): 1 consumer warpgroup x 64 / 128 weight rows or 2 x 128 / 256, x tiles of 16..256 rows
(M rounded up, and 64 / 128 / 256 up to M), stream-K program counts (w4a16_streamk.stream_k_plan), ring depths whose
stages fit the shared memory (two programs an SM with one consumer). --extra adds named K:N shapes (e.g. one
slice of a layer's columns: what a wave of its tiles costs alone).
"""
import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import SHAPES, alternating_us, checked_us, frag_layer, graph_us  # noqa: E402
from quant_serve.kernels.w4a16 import w4a16_forward  # noqa: E402
from quant_serve.kernels.w4a16_frag import prepare_frag  # noqa: E402
from quant_serve.kernels.w4a16_tiles import frag_dequantize  # noqa: E402
from quant_serve.kernels.w4a16_ref import dequantize_w4, pack_int4_rows  # noqa: E402
import quant_serve.kernels.w4a16_tma as tma_module  # noqa: E402
from quant_serve.kernels.w4a16_tma import w4a16_tma  # noqa: E402

DEV = "cuda"
# (K, N, M, group size, zero points, config): N past the tile, K padded to 64, odd step counts in a split
# (K, N, M, group size, zero points, config, SMs the plan assumes): N past the tile, K padded to 64, stream-K
# segments of odd step counts, whole waves before a split tail (few SMs assumed: small shapes, several waves)
CHECKS = [(256, 256, 64, 128, True, {}, 0), (512, 272, 100, 32, True, {"consumers": 1, "block_n": 64}, 0),
          (384, 256, 300, -1, True, {}, 0), (1024, 512, 256, 128, True, {"block_n": 256, "block_m": 128}, 0),
          (1000, 256, 64, 0, False, {}, 0), (1088, 512, 99, 64, True, {"sk_programs": 7}, 0),
          (4096, 4096, 77, 64, False, {"consumers": 1, "sk_programs": 37, "block_n": 64, "stages": 6}, 0),
          (2048, 512, 17, 128, True, {"block_m": 32}, 0), (1152, 2000, 300, 128, True, {"block_m": 128}, 5),
          (2048, 1040, 64, 64, True, {"consumers": 1, "block_n": 64}, 3),
          (1088, 512, 99, 64, True, {"consumers": 1, "sk_programs": 7, "overlap": True}, 0),
          (1152, 2000, 300, 128, True, {"consumers": 1, "block_n": 64, "block_m": 128, "overlap": True}, 5),
          (2048, 1040, 64, 64, True, {"consumers": 1, "block_n": 64, "overlap": True}, 3),
          (256, 256, 40, 128, True, {"consumers": 1, "block_n": 128, "sk_programs": 8, "overlap": True}, 0),
          (3584, 4608, 64, 128, True, {"consumers": 1, "block_n": 128, "block_m": 64, "overlap": True}, 0),
          (1152, 2000, 300, 128, True, {"consumers": 1, "block_n": 64, "block_m": 128, "block_k": 128, "stages": 2,
                                        "overlap": True}, 5),
          (1408, 1040, 64, 128, True, {"consumers": 1, "block_n": 64, "block_k": 128, "overlap": True}, 3),
          (1280, 512, 99, 64, True, {"consumers": 1, "sk_programs": 7, "block_k": 128, "overlap": True}, 0),
          (2048, 512, 40, -1, False, {"consumers": 1, "block_n": 64, "block_m": 32, "block_k": 128}, 0),
          (1024, 512, 256, 128, True, {"block_n": 256, "block_m": 128, "block_k": 128, "stages": 2}, 0)]


def check_one(k, n, m, group, zeros, cfg, sms) -> dict:
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
    real_sms = tma_module.device_sms
    if sms:
        tma_module.device_sms = lambda device: sms
    try:
        y1, y2 = (w4a16_tma(x, fw, bias, **cfg).float() for _ in range(2))
    finally:
        tma_module.device_sms = real_sms
    err = ((y1 - ref).norm() / ref.norm()).item()
    return {"k": k, "n": n, "m": m, "group": group, "zeros": zeros, "config": cfg, "sms": sms, "rel_err": err,
            "repeat_bitwise": bool(torch.equal(y1, y2))}


SMEM_PER_SM = 227 * 1024


def ring_fits(cons: int, bn: int, bm: int, stages: int, bk: int = 64) -> bool:
    """A ring of `stages` stages (words bn x bk / 2 bytes + x bm x bk x 2) fits beside the epilogue's shared tile:
    two programs an SM with one consumer, one with two."""
    ring = stages * (bn * bk // 2 + bm * bk * 2)
    return ring + bn * bm * 2 <= SMEM_PER_SM // (3 - cons)


def candidates(m: int, k: int, n: int, stages=(4,), sms: int = 132, block_ks=(64,), plan_only=False) -> list[dict]:
    """Tiles x stream-K program counts: the plan's (0; plan_only: only it), none split (the tail tiles one a
    program), each tail tile split in 2..8 equal K ranges (one a program), and the tail's steps spread 8 a program;
    one consumer with and without each step's dequant beside the previous step's wgmma (overlap; with two, ptxas
    serializes it); each K step of 64 or 128 rows (block_k; 128 halves the steps and their barriers, at a ring of
    fewer stages)."""
    bms = sorted({min(256, max(16, 1 << (m - 1).bit_length()))} | {b for b in (64, 128, 256) if b <= max(64, m)})
    out = []
    for cons, bns in ((2, (128, 256)), (1, (64, 128))):
        for bn in bns:
            for bm in bms:
                if bm > 128 * cons or (bn // cons == 128 and bm == 256):
                    continue
                slots = sms * (3 - cons)
                tail = -(-n // bn) * -(-m // bm) % slots
                for bk in block_ks:
                    units = tail * (k // bk)
                    sks = sorted({0, tail, min(slots, units // 8)} | {tail * sp for sp in range(2, 9)
                                                                       if tail * sp <= slots and k // bk >= 4 * sp}) \
                        if tail and not plan_only else [0]
                    # 128-row K steps: the deepest ring that fits (a sweep over 2..4 stages would triple the count)
                    sts = stages if bk == 64 else [max([s for s in (2, 3, 4) if ring_fits(cons, bn, bm, s, bk)],
                                                       default=0)]
                    out += [dict(consumers=cons, block_n=bn, block_m=bm, sk_programs=sk, stages=st,
                                 **({"block_k": bk} if bk != 64 else {}), **({"overlap": True} if ov else {}))
                            for sk in sks for st in sts for ov in ((False, True) if cons == 1 else (False,))
                            if st and ring_fits(cons, bn, bm, st, bk)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-tma-sk-h200.json")
    ap.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--stages", default="4")
    ap.add_argument("--block-k", default="64", help="K rows a step: 64, 128 or both")
    ap.add_argument("--confirm", type=int, default=0,
                    help="then time the best N candidates, the dispatcher and FP16 in turn, three rounds")
    ap.add_argument("--plan-only", action="store_true", help="only stream_k_plan's program count a tile")
    ap.add_argument("--tiles", default="", help="only these cons:bn:bm tiles, e.g. 1:64:128,2:128:256")
    ap.add_argument("--extra", default="", help="name=K:N,... shapes besides the Qwen2.5-7B ones")
    args = ap.parse_args()
    shapes = dict(SHAPES)
    for item in filter(None, args.extra.split(",")):
        name, kn = item.split("=")
        shapes[name] = tuple(int(v) for v in kn.split(":"))
    stages = tuple(int(v) for v in args.stages.split(","))
    block_ks = tuple(int(v) for v in args.block_k.split(","))
    tiles = {tuple(int(v) for v in t.split(":")) for t in filter(None, args.tiles.split(","))}
    start = time.time()
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "shapes": shapes,
              "checks": [check_one(*c) for c in CHECKS], "points": []}
    bad = [c for c in result["checks"] if not (c["rel_err"] < 2e-3 and c["repeat_bitwise"])]
    print(f"checks: {len(bad)} bad of {len(CHECKS)}", flush=True)
    if bad:
        raise SystemExit(json.dumps(bad))
    for name in args.shapes.split(","):
        k, n = shapes[name]
        ref_w, fws, dense, _ = frag_layer(k, n)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, dtype=torch.float16, device=DEV)
            ref = x.float() @ ref_w
            point = {"shape": name, "m": m, "fp16_us": graph_us([lambda d=d: torch.mm(x, d) for d in dense]),
                     "dispatcher_us": graph_us([lambda f=f: w4a16_forward(x, f) for f in fws]),
                     "dequant_cublas_us": graph_us([lambda f=f: torch.mm(x, frag_dequantize(f).t()) for f in fws]),
                     "tma": [checked_us(lambda f, **c: w4a16_tma(x, f, **c), fws, ref, c)
                             for c in candidates(m, k, n, stages, block_ks=block_ks, plan_only=args.plan_only)
                             if not tiles or (c["consumers"], c["block_n"], c["block_m"]) in tiles]}
            timed_ok = [c for c in point["tma"] if "us" in c]
            def variant(c):
                return (c.get("block_k", 64), c["consumers"], c.get("overlap", False))
            best = {}
            for c in timed_ok:
                v = variant(c["config"])
                if v not in best or c["us"] < best[v]["us"]:
                    best[v] = c
            print(f"{name} M={m}: fp16 {point['fp16_us']:.1f} dispatcher {point['dispatcher_us']:.1f} tma best " +
                  " | ".join(f"{b['us']:.1f} {tuple(b['config'].values())}" for b in best.values()), flush=True)
            if args.confirm:       # a sweep's one reading a candidate favours whichever drew a fast moment
                top = sorted(timed_ok, key=lambda c: c["us"])[:args.confirm]
                calls = {"fp16": [lambda d=d: torch.mm(x, d) for d in dense],
                         "dispatcher": [lambda f=f: w4a16_forward(x, f) for f in fws]}
                calls.update({json.dumps(c["config"]): [lambda f=f, c=c: w4a16_tma(x, f, **c["config"]) for f in fws]
                              for c in top})
                point["confirm"] = alternating_us(calls)
                print("   confirm: " + " | ".join(f"{median(v):.1f} {name}" for name, v in point["confirm"].items()),
                      flush=True)
            result["points"].append(point)
            result["wall_s"] = time.time() - start
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))     # after every point: a cut run keeps them
        del fws, dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
