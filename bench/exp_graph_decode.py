"""Experiment: the decode configuration inside CUDA graphs. A decode graph's block table is max_model_len wide
(engine/cuda_graph.py), so the split count is fixed at capture while each split's length follows the sequence's
own context (attention_triton._decode_kernel). This times paged_decode with the new token folded in (RoPE + store,
as the decode step runs it) over a table of --table tokens at contexts below it, for the wide-table default and the
candidates of bench/kernels.py --tune-decode, fp16 and fp8 (e4m3) KV, Qwen2.5-7B heads (28 q, 4 kv, 128).
Run: PYTHONPATH=. python bench/exp_graph_decode.py --out bench/results/exp-graph-decode-h200.json"""
import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.kernels import config_us, copies  # noqa: E402
from quant_serve.kernels.paged_attention import DecodeConfig, NewTokens, paged_decode  # noqa: E402

DEV = "cuda"
HQ, HKV, D, BS = 28, 4, 128, 16
CANDIDATES = [DecodeConfig(block_n=bn, num_stages=st, waves=wv, min_split_tokens=mt, fp8_asm=asm)
              for asm in (False, True) for bn in (64, 128) for st in (2, 3)
              for wv, mt in ((2.0, 256), (4.0, 128), (8.0, 64), (4.0, 64))]


def point(batch: int, ctx: int, table_tokens: int, dtype: torch.dtype) -> dict:
    nblk = table_tokens // BS
    tables = torch.randperm(batch * nblk, device=DEV).view(batch, nblk).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, dtype=torch.float16, device=DEV)
    new = NewTokens(torch.randn(batch, HKV, D, dtype=torch.float16, device=DEV),
                    torch.randn(batch, HKV, D, dtype=torch.float16, device=DEV), (lens - 1).long(),
                    torch.randn(table_tokens, D, dtype=torch.float16, device=DEV),
                    torch.full((batch,), -1, dtype=torch.long, device=DEV))
    scale = torch.tensor(1.0, device=DEV)
    shape = (batch * nblk, BS, HKV, D)
    sets = [(torch.randn(shape, device=DEV).to(dtype), torch.randn(shape, device=DEV).to(dtype))
            for _ in range(copies(2 * batch * ctx * HKV * D * dtype.itemsize))]
    is_fp8 = dtype != torch.float16

    def call(kv, cfg=None, wide=True):
        return paged_decode(q, *kv, tables, lens, qsl, D ** -0.5, scale, scale, cfg=cfg, new=new, wide_table=wide)

    row = {"batch": batch, "ctx": ctx, "table": table_tokens, "kv": "fp8" if is_fp8 else "fp16",
           "default_us": config_us(call, sets, True)}
    row["all"] = [dict(dataclasses.asdict(c), us=config_us(lambda kv, c=c: call(kv, c), sets, False))
                  for c in CANDIDATES if is_fp8 or not c.fp8_asm]
    best = min(row["all"], key=lambda e: e["us"])
    row["best_us"], row["best"] = best["us"], {k: v for k, v in best.items() if k != "us"}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/exp-graph-decode-h200.json")
    ap.add_argument("--table", type=int, default=4096, help="block-table width in tokens (max_model_len)")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--ctxs", default="512,1024,2048,4096")
    args = ap.parse_args()
    t0 = time.time()
    out = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "timer": "us per call, CUDA-graph replay over rotated caches (bench/kernels.graph_us)", "rows": []}
    for batch in (int(v) for v in args.batches.split(",")):
        for ctx in (int(v) for v in args.ctxs.split(",")):
            for dtype in (torch.float16, torch.float8_e4m3fn):
                row = point(batch, ctx, args.table, dtype)
                out["rows"].append(row)
                print(f"B={batch:3d} ctx={ctx:5d} {row['kv']:4s} default {row['default_us']:6.1f} "
                      f"best {row['best_us']:6.1f} {row['best']}  t={time.time() - t0:.0f}s", flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
