"""What the card model's fit (engine/card_fit.py) needs from one GPU under one kernel profile, in one run:

    python bench/card_model.py --profile a10 --out $OUT/card-model-h100-a10.json

- copy bandwidth (bench/kernel_speed.py's copy_bandwidth);
- per-layer matmul times, Qwen2.5-7B shapes (and the FP16 head) at M = 1 .. 2048: FP16 cuBLAS, our INT4 plan (AWQ
  g128 in the loader's layout) and GGUF Q4_K / Q6_K (fragment layout), each with the kernel the plan picked, timed by
  kernel_speed's graph_us (CUDA-graph replay over rotated weight copies of >= 256 MB, median of 5);
- decode attention (fp16 and fp8 KV) at a few batch x context points;
- end to end on dummy weights under a 24 GiB cap (bench/e2e.py's engines): decode tok/s at batch 1 and 32 (128-token
  prompts, 128 new tokens: 192 tokens of context on average) and the prefill of one 512- and one 4096-token prompt
  (median of 3), for Qwen2.5-7B AWQ, Llama-3.1-8B GPTQ and Qwen2.5-7B GGUF Q4_K_M, FP16 KV.

One JSON with command, commit, GPU, profile; card-model-*.json files in bench/results/ from two GPUs of one plan
replace the committed runs the fit otherwise reads (engine/card_refit.py). About 4-5 minutes on an H100.
"""
import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

# bench/ is no package: run as a script, its folder is on sys.path and its siblings import by name
from kernel_speed import copies, copy_bandwidth, graph_us, ours_config, random_int4, rotated

from quant_serve.engine.loader import BUNDLED_CONFIGS
from quant_serve.kernels.gpu import PROFILE_NAMES, PROFILES, KernelOptions, configure
from quant_serve.kernels.w4a16.dispatch import prepare_kernel_weights, w4a16_forward

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
HEAD = (3584, 152064)
MS = (1, 8, 16, 32, 64, 128, 512, 2048)
GGUF = {"gguf-q4_k": ("qkv", "gate_up"), "gguf-q6_k-frag": ("down",)}      # Q4_K_M's main types
GGUF_MS = (1, 16, 32, 64)
ATTENTION = ((1, 512), (1, 4096), (32, 256), (32, 1024), (32, 4096), (128, 1024))
E2E = (("qwen2.5-7b-awq", True), ("llama-3.1-8b-gptq", False), ("qwen2.5-7b-gguf-q4_k_m", False))


def gpu_key(name: str) -> str | None:
    """The PROFILES key of the GPU the run is on (the fit needs its datasheet rates)."""
    for key in ("h200", "h100", "a100", "l4", "a10", "4090", "3090"):
        if key in name.lower().replace("rtx ", ""):
            return key
    return next((k for k, c in PROFILES.items() if c.name == name), None)


def bench_matmuls(log) -> list[dict]:
    rows = []
    for name, (k, n) in SHAPES.items():
        w = rotated(prepare_kernel_weights(*random_int4(k, n), 128), k, n)
        dense = [torch.randn(k, n, dtype=torch.float16, device="cuda") * 0.02 for _ in range(copies(k * n * 2))]
        for m in MS:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            fp16 = graph_us([lambda d=d: torch.mm(x, d) for d in dense])
            ours = graph_us([lambda ws=ws: w4a16_forward(x, ws) for ws in w])
            kernel = ours_config(w[0], m, k, n)["kernel"]
            rows += [{"format": "fp16", "shape": name, "k": k, "n": n, "m": m, "kernel": "cublas", "us": fp16},
                     {"format": "ours", "shape": name, "k": k, "n": n, "m": m, "kernel": kernel, "us": ours}]
            log(f"{name:8s} M={m:5d} fp16 {fp16:8.1f} us  int4 {ours:8.1f} us ({kernel})")
        del w, dense
        torch.cuda.empty_cache()
    k, n = HEAD
    head = [torch.randn(k, n, dtype=torch.float16, device="cuda") * 0.02 for _ in range(2)]
    for m in (1, 32):
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        us = graph_us([lambda d=d: torch.mm(x, d) for d in head])
        rows.append({"format": "fp16", "shape": "head", "k": k, "n": n, "m": m, "kernel": "cublas", "us": us})
    del head
    torch.cuda.empty_cache()
    return rows


def bench_gguf(sms: int, log) -> list[dict]:
    from gguf_kernel_speed import planned, random_layer
    rows = []
    for fmt, names in GGUF.items():
        for name in names:
            k, n = SHAPES[name]
            layer0 = random_layer(fmt, k, n)
            layers = [layer0] + [random_layer(fmt, k, n) for _ in range(copies(layer0["nbytes"]) - 1)]
            for m in GGUF_MS:
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                kernel, _ = planned(fmt, layer0, x, sms)
                us = graph_us([lambda layer=layer: layer["call"](x) for layer in layers])
                rows.append({"format": fmt, "shape": name, "k": k, "n": n, "m": m, "kernel": kernel, "us": us})
                log(f"{fmt} {name:8s} M={m:3d} {us:8.1f} us ({kernel})")
            del layers, layer0
            torch.cuda.empty_cache()
    return rows


def bench_attention(log) -> list[dict]:
    """Qwen2.5-7B decode attention (28 q heads, 4 kv heads, head_dim 128), one token a sequence."""
    from quant_serve.kernels.paged_attention import paged_decode
    hq, hkv, d, bs = 28, 4, 128, 16
    rows = []
    for batch, ctx in ATTENTION:
        nblk = ctx // bs
        tables = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, hq, d, dtype=torch.float16, device="cuda")
        one = torch.tensor(1.0, device="cuda")
        for dtype in (torch.float16, torch.float8_e4m3fn):
            kv_bytes = 2 * batch * ctx * hkv * d * dtype.itemsize
            sets = [tuple(torch.randn(batch * nblk, bs, hkv, d, device="cuda").to(dtype) for _ in range(2))
                    for _ in range(copies(kv_bytes))]
            us = graph_us([lambda kv=kv: paged_decode(q, *kv, tables, lens, qsl, d ** -0.5, one, one) for kv in sets])
            rows.append({"batch": batch, "context": ctx, "kv_bytes": dtype.itemsize,
                         "bytes": kv_bytes + 4 * batch * hq * d, "us": us})
            log(f"attention B={batch:4d} ctx={ctx:5d} {str(dtype)[6:]:14s} {us:8.1f} us")
            del sets
    torch.cuda.empty_cache()
    return rows


def prefill_seconds(engine, prompt: int, repeats: int = 3) -> float:
    """Wall time from adding one prompt of `prompt` tokens (max_tokens 1) to its output: the prefill steps."""
    from quant_serve.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for i in range(repeats + 1):                          # the first one compiles the prefill shapes
        ids = torch.randint(10, 1000, (prompt,)).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"prefill-{prompt}-{i}", ids, params)
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_e2e(log, deadline: float) -> list[dict]:
    import e2e
    from quant_serve.server.bench_offline import run_offline
    rows = []
    for name, prefill in E2E:
        if time.time() > deadline:
            log(f"skipping {name}: past the time budget")
            break
        config = BUNDLED_CONFIGS / e2e.CONFIGS[name].name          # the configs shipped with the package
        engine = e2e.engine_for(config, "auto", max_num_seqs=256, max_model_len=8192,
                                enforce_eager=False, quantization=e2e.QUANTIZATION.get(name))
        chunk = engine.config.scheduler.max_num_batched_tokens
        b1 = run_offline(engine, 1, 128, 128)
        b32 = run_offline(engine, 32, 128, 128)
        rows += [{"model": name, "kv": "auto", "kind": "decode", "batch": 1, "context": 192,
                  "tok_s": b1["decode_tok_s"]},
                 {"model": name, "kv": "auto", "kind": "decode", "batch": 32, "context": 192,
                  "tok_s": 32 / b32["tpot_p50_s"]}]
        log(f"{name}: batch 1 {rows[-2]['tok_s']:.1f} tok/s, batch 32 {rows[-1]['tok_s']:.0f} tok/s")
        for prompt in ((512, 4096) if prefill else (512,)):
            seconds = prefill_seconds(engine, prompt)
            rows.append({"model": name, "kv": "auto", "kind": "prefill", "prompt": prompt, "chunk": chunk,
                         "seconds": seconds, "tok_s": prompt / seconds})
            log(f"{name}: prefill {prompt} tokens {seconds * 1e3:.1f} ms ({prompt / seconds:.0f} tok/s)")
        del engine
        gc.collect()
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="this", choices=PROFILE_NAMES, help="the kernel plan (kernels/gpu.py)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no end-to-end model after this")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: matmuls,gguf,attention,e2e")
    args = ap.parse_args()
    start = time.time()
    caps = configure(0, KernelOptions(profile=args.profile)).caps
    import e2e
    e2e.KERNELS[0] = KernelOptions(profile=args.profile)         # the engines' kernel plan
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    name = torch.cuda.get_device_name()
    result = {"command": " ".join(sys.argv), "git_commit": git.stdout.strip() or "unknown", "gpu": name,
              "gpu_key": gpu_key(name), "profile": args.profile, "plan_sms": caps.sms, "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
              "timer": "kernels: us per call, CUDA-graph replay over rotated weights (median of 5); e2e: bench/e2e.py "
                       "engines, dummy weights, 24 GiB cap, FP16 KV",
              "matmuls": [], "attention": [], "e2e": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def log(text):
        print(f"[{time.time() - start:6.1f}s] {text}", flush=True)
    result["copy_TBps"] = copy_bandwidth()
    log(f"{name} ({result['gpu_key']}), profile {args.profile}: copy {result['copy_TBps']:.2f} TB/s")
    skip = set(filter(None, args.skip.split(",")))
    sections = (("matmuls", "matmuls", lambda: bench_matmuls(log)),
                ("gguf", "matmuls", lambda: bench_gguf(caps.sms, log)),
                ("attention", "attention", lambda: bench_attention(log)),
                ("e2e", "e2e", lambda: bench_e2e(log, start + args.budget_s)))
    for section, key, run in sections:
        if section in skip:
            continue
        try:
            result[key] += run()
        except Exception as e:                    # keep what the other sections measured
            result[f"{section}_error"] = repr(e)[:400]
            log(f"{section} failed: {e!r}")
        result["wall_s"] = time.time() - start
        out.write_text(json.dumps(result, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
