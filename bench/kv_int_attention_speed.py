"""Decode attention of one layer with an integer KV cache against fp8 (issue #56: "decode attention at 8k context no
slower than the FP8 cache"), Qwen2.5-7B heads (28 query, 4 KV, head_dim 128), one new token per sequence.

What is timed is the layer's whole attention step as the engine runs it (engine/worker/attention.py
paged_attention_forward: RoPE, the store, attention; for the integer caches also the Hadamard rotation and, with an
exact window, its ring reads and write), replayed from a CUDA graph as a decode step is, over several cache copies
that together exceed the L2. Caches: fp8 e4m3 (the fused decode kernel), int8, int4 without a window and int4 with
its default window (kernels/attention/kv_exact.py). Each row gives us and the ratio to fp8.

    python bench/kv_int_attention_speed.py [--batches 1 16 64] [--ctxs 1024 8192 32768] [--gpu-profile a10]
                                           [--out bench/results/kv-int-attention-h100.json]
    python bench/kv_int_attention_speed.py --smoke     # the CPU: tiny shapes through the interpreter, no timing
"""
import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from statistics import median

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from quant_serve.engine.worker.attention import AttentionMetadata, paged_attention_forward  # noqa: E402
from quant_serve.kernels.attention.kv_exact import ExactRows, alloc_rings  # noqa: E402
from quant_serve.kernels.attention.kv_int import alloc_int_cache, hadamard, int_kv_exact_tokens  # noqa: E402
from quant_serve.kernels.attention.kv_int import int_kv_format  # noqa: E402
from quant_serve.kernels.attention.reference import build_cos_sin_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, D, BS = 28, 4, 128, 16
CACHES = ("fp8", "int8", "int4 no window", "int4")


def make_layer(cache: str, batch: int, ctx: int, device) -> dict:
    """One layer's cache of `cache` for batch sequences of ctx tokens, filled with random values, and what the
    forward reads: (k_cache, v_cache, k_scale, v_scale, rotation, rings)."""
    blocks = batch * (ctx // BS + 1)
    if cache == "fp8":
        k, v = (torch.randn(blocks, BS, HKV, D, device=device).to(torch.float8_e4m3fn) for _ in range(2))
        one = torch.ones((), device=device)
        return dict(k_cache=k, v_cache=v, k_scale=one, v_scale=one, rotation=None, rings=None)
    dtype = cache.split()[0]
    fmt = int_kv_format(dtype, D)
    (kc, ks), (vc, vs) = (alloc_int_cache(fmt, blocks, BS, HKV, D, device) for _ in range(2))
    for c in (kc, vc):
        c.copy_(torch.randint(0, 255 if dtype == "int4" else 127, c.shape, device=device).to(c.dtype))
    for s in (ks, vs):
        s.copy_(torch.rand(s.shape, device=device) * 0.1)
    window = int_kv_exact_tokens(dtype) if cache == dtype else 0
    rings = alloc_rings(batch + 1, window, HKV, D, torch.float16, device) if window else None
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, rings=rings,
                rotation=hadamard(D, device) if fmt.rotate else None)


def make_meta(batch: int, ctx: int, window: int, device) -> AttentionMetadata:
    """A decode step: sequence b at position ctx - 1 of its own blocks, its ring holding the window before it."""
    per = ctx // BS + 1
    tables = torch.arange(batch * per, dtype=torch.int32, device=device).view(batch, per)
    pos = ctx - 1
    slots = (tables[:, pos // BS].long() * BS + pos % BS)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device),
                             query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                             max_seq_len=ctx, max_query_len=1)
    if window:
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        meta.exact_rows = ExactRows(rows, torch.full_like(rows, max(0, pos - window)), torch.full_like(rows, pos),
                                    rows.long() * window + pos % window)
    return meta


def step_fn(cache: str, batch: int, ctx: int, device):
    """A zero-argument call of one layer's decode attention, and its inputs kept alive."""
    layer = make_layer(cache, batch, ctx, device)
    window = layer["rings"][0].shape[1] if layer["rings"] is not None else 0
    meta = make_meta(batch, ctx, window, device)
    cos_sin = build_cos_sin_cache(ctx + 1, D, base=1e6, device=device)
    positions = torch.full((batch,), ctx - 1, dtype=torch.long, device=device)
    q, k, v = (torch.randn(batch, h, D, dtype=torch.float16, device=device) for h in (HQ, HKV, HKV))

    def call():
        return paged_attention_forward(q.clone(), k.clone(), v.clone(), positions, cos_sin, layer["k_cache"],
                                       layer["v_cache"], layer["k_scale"], layer["v_scale"], meta, D ** -0.5,
                                       rotation=layer["rotation"], rings=layer["rings"])
    return call, layer


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return out + ("+dirty" if dirty.strip() else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--ctxs", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--gpu-profile", default=None, help="run the kernels under this card's plan (kernels/gpu.py)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter), no timing")
    args = p.parse_args(argv)
    if args.smoke:
        for cache in CACHES:
            call, _ = step_fn(cache, 2, 40, "cpu")
            out = call()
            assert out.shape == (2, HQ, D) and torch.isfinite(out).all(), cache
        print("smoke: every cache's decode attention ran")
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_speed import alternating_us, copies          # bench/kernel_speed.py's CUDA-graph timing
    from quant_serve.kernels.gpu import KernelOptions, configure
    configure(torch.device("cuda"), KernelOptions(profile=args.gpu_profile or "this"))
    rows = []
    for batch in args.batches:
        for ctx in args.ctxs:
            calls = {}
            for cache in CACHES:
                nbytes = 2 * batch * ctx * HKV * D * (1 if cache in ("fp8", "int8") else 0.5)
                calls[cache] = [step_fn(cache, batch, ctx, "cuda")[0] for _ in range(copies(int(nbytes)))]
            runs = alternating_us(calls)
            row = {"batch": batch, "ctx": ctx}
            for cache in CACHES:
                row[f"{cache}_us"], row[f"{cache}_runs_us"] = median(runs[cache]), runs[cache]
                row[f"{cache}_over_fp8"] = row[f"{cache}_us"] / median(runs["fp8"])
            rows.append(row)
            print(f"B={batch:3d} ctx={ctx:6d} " + "  ".join(f"{c} {row[f'{c}_us']:8.1f} us" for c in CACHES),
                  flush=True)
            del calls
            torch.cuda.empty_cache()
    at_8k = [r for r in rows if r["ctx"] == 8192]
    result = {"command": "python bench/kv_int_attention_speed.py " + " ".join(argv or sys.argv[1:]),
              "commit": git_commit(), "gpu": torch.cuda.get_device_name(), "profile": args.gpu_profile or "native",
              "host": platform.node(), "rows": rows,
              "summary": {f"{c}_over_fp8_at_8k_worst": max((r[f"{c}_over_fp8"] for r in at_8k), default=None)
                          for c in CACHES[1:]}}
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
