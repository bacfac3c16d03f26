"""Kernel benchmarks on one GPU, anchors measured in the same run (the targets and how they are measured: docs/performance.md).

W4A16 (g128, zero points) on the Qwen2.5-7B layer shapes: FP16 cuBLAS, our dispatcher, torch tinygemm int4 and
AutoAWQ 0.2.9's Triton GEMM (imported by file path from the sdist given with --awq-sdist). Paged decode attention:
fp16 vs fp8 e4m3 KV, and torch SDPA on an unpaged fp16 cache. Times (us) are GPU times per call: the calls are
captured in a CUDA graph (as the engine's decode steps are) over enough rotated weight copies (>= 256 MB) that no
weight is served from L2; median of 5 replays. fp16_dobench_us is triton.testing.do_bench (eager, L2 flushed) for
comparison with the anchors in targets.md. Where kernels/pdl.py launches with PDL (sm90), ours_no_pdl_us times the
same calls launched plainly (M <= 128; summary "ours_no_pdl"). --tune also times kernels/matmul/rules.py's search space.

  python bench/kernel_speed.py --out bench/results/kernels-h200.json [--tune] [--awq-sdist F.tar.gz] [--profile a10]

--profile runs every kernel choice under a GPU profile (kernels/gpu.py: a10, 3090, 4090, l4, ...): on the H200 the
sm86 / sm89 plans (no TMA, wgmma or PDL, their shared memory and SM count). "dequant_us" times the dequantize pass
+ cuBLAS beside ours from M = 64, the alternative the plan may pick where it is faster.

M = 1 sweep (gemv: two/one launch x register prefetch/cp.async 2-4 stages x BLOCK_N x warps x split, ~380
candidates per shape, every one checked against the exact reference before and after timing; prints the tuning-table
rows and stores them in the JSON's table_rows):
  python bench/kernel_speed.py --tune --no-decode --ms 1 --budget-s 270 \
      --out bench/results/kernels-tune-gemv-h200.json

GGUF weight formats (bench/gguf_kernel_speed.py: the planned kernel of each format against FP16 cuBLAS, no
attention section):
  python bench/kernel_speed.py --weights gguf-q4_k,q8_0 --out bench/results/kernels-gguf-h200.json
"""
import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from statistics import median


import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from quant_serve.kernels.attention.paged import DecodeConfig, paged_decode  # noqa: E402
from quant_serve.kernels.gpu import PROFILE_NAMES, KernelOptions, configure, runtime_for  # noqa: E402
from quant_serve.kernels.pdl import pdl_enabled  # noqa: E402
from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights, w4a16_forward  # noqa: E402
from quant_serve.kernels.matmul.frag.layout import FragWeights  # noqa: E402
from quant_serve.kernels.matmul.frag.tiles import frag_dequantize  # noqa: E402
from quant_serve.kernels.matmul.plan import plan_w4a16
from quant_serve.kernels.matmul.probes import probed_runtime
from quant_serve.kernels.matmul.reference import dequantize_w4  # noqa: E402
from quant_serve.kernels.matmul.rows.layout import prepare_w4a16  # noqa: E402
from quant_serve.kernels.matmul.rules import W4A16Config  # noqa: E402
from quant_serve.kernels.matmul.sweep import candidate_configs, refinements, table_row  # noqa: E402

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
# --shapes may add: Q4_K_M's Q6_K layers are v (beside Q4_K q / k) and half the downs, and the head
MORE_SHAPES = {"v": (3584, 512), "head": (3584, 152064)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
TUNE_MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
DECODE_BATCHES, DECODE_CTXS = (1, 4, 16, 64, 256), (512, 2048, 8192)
GS = 128
DEV = "cuda"


def us(fn) -> float:
    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def graph_us(fns, min_ms: float = 2.0) -> float:
    """Median GPU time per call of the calls in `fns` (one per rotated input set), replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                # warm-up off the capture: compiles, cuBLAS workspaces
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in fns:
        f()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, int(min_ms / max(start.elapsed_time(end), 1e-3)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    times = []
    for _ in range(5):
        start.record(), graph.replay(), end.record(), torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(fns)))
    return sorted(times)[2]


def alternating_us(calls: dict, rounds: int = 3) -> dict:
    """{name: [us, ...]}: each entry's graph_us, the entries in turn, `rounds` times. Clock and power drift between
    two readings then lands on every side: one reading each put the same call of gate_up at M = 1024 at 395 us here
    and 364-371 in the same process around it (exp-timing-ab-h200.json at tag lab-archive-2026-12;
    docs/kernels.md, "Timing")."""
    runs = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fns in calls.items():
            runs[name].append(graph_us(fns))
    return runs


def timed(row: dict, key: str, fns) -> None:
    """row[key_us] = graph_us(fns), or row[key_error]: an anchor that fails must not cost the run."""
    try:
        row[f"{key}_us"] = graph_us(fns)
    except Exception as e:
        row[f"{key}_error"] = repr(e)[:300]
        torch.cuda.synchronize()


def copies(nbytes: int) -> int:
    """Rotated weight copies that together exceed the L2 several times."""
    return max(2, min(32, -(-(256 << 20) // nbytes)))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written, TB/s."""
    a, b = (torch.empty(2 ** 31, dtype=torch.uint8, device=DEV) for _ in range(2))
    return 2 * a.numel() / us(lambda: b.copy_(a)) / 1e6


def load_awq(sdist: str):
    """awq/modules/triton/gemm.py from the AutoAWQ sdist, imported alone (it needs only torch and triton)."""
    if not sdist:
        return None
    tmp = Path(tempfile.mkdtemp())
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("awq/modules/triton/gemm.py"))
        tar.extract(member, tmp, filter="data")
    spec = importlib.util.spec_from_file_location("awq_triton_gemm", tmp / member.name)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


def ours_config(w, m, k, n) -> dict:
    """The plan's choice for this call (kernels/matmul/plan.py), as recorded in the JSON."""
    rt = probed_runtime(torch.device(DEV))
    p = plan_w4a16(m, k, n, rt.caps, rt.options, "frag" if isinstance(w, FragWeights) else "rows")
    return {"kernel": p.kernel, "why": p.why, **(dataclasses.asdict(p.config) if p.config else {})}


def nbytes(m, k, n, int4=True):
    """Bytes a layer call must move: weights (+ g128 scales and packed zeros for INT4), x and y."""
    return (k * n // 2 + (k // GS) * n * 5 // 2 if int4 else k * n * 2) + m * k * 2 + m * n * 2


def tune_point(x, ws, m, k, n, deadline, ref):
    """Time every candidate (after checking it against the exact reference), refine the winner;
    -> (list of {config, us, rel_err}, best). A candidate with rel_err > 2e-3 is recorded, never chosen."""
    rows = []
    seen = set()

    def check(cfg, weights):
        y = w4a16_forward(x, weights[0], None, cfg).float()
        return ((y - ref).norm() / ref.norm()).item()

    def run(cfg, weights, tag=""):
        if cfg in seen:                                          # a refinement the sweep already timed
            return
        seen.add(cfg)
        try:
            err = check(cfg, weights)
            if not err < 2e-3:
                rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights[0].pack_k, "rel_err": err,
                             "error": "wrong result"})
                return
            fns = [lambda w=w: w4a16_forward(x, w, None, cfg) for w in weights]
            t = graph_us(fns)
            err = max(err, check(cfg, weights))     # again after hundreds of replays (split-K counters reset)
            if not err < 2e-3:
                rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights[0].pack_k, "rel_err": err,
                             "error": "wrong result after timing"})
                return
            rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights[0].pack_k, "us": t,
                         "tag": tag, "rel_err": err})
        except Exception as e:                                   # a config the compiler rejects (resources)
            rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights[0].pack_k, "error": repr(e)[:200]})

    for cfg in candidate_configs(m, k, n):
        if time.time() > deadline:
            break
        run(cfg, ws)
    timed = [r for r in rows if "us" in r]
    if not timed:
        return rows, None
    best = min(timed, key=lambda r: r["us"])
    best_cfg = W4A16Config(**best["config"])
    for cfg in refinements(best_cfg):
        run(cfg, ws, "refine")
    timed = [r for r in rows if "us" in r]
    return rows, min(timed, key=lambda r: r["us"])


def random_int4(k, n):
    """Random g128 INT4 weights with zero points: qweight [K/8, N], scales [G, N] fp16, qzeros [G, N/8]."""
    g = k // GS
    qweight = torch.randint(-2 ** 31, 2 ** 31, (k // 8, n), dtype=torch.int32, device=DEV)
    qzeros = torch.randint(-2 ** 31, 2 ** 31, (g, n // 8), dtype=torch.int32, device=DEV)
    return qweight, (torch.rand(g, n, device=DEV) * 0.01 + 0.001).half(), qzeros


def rotated(w, k, n):
    """w and copies of it (words, scales and zeros cloned) that together exceed the L2: calls rotate through them,
    so every call reads its weights from DRAM, as a model's layers do."""
    def clone(w):
        words = {"words": w.words.clone()} if isinstance(w, FragWeights) else {"qweight": w.qweight.clone()}
        return dataclasses.replace(w, scales=w.scales.clone(), qzeros=w.qzeros.clone(), **words)
    return [w] + [clone(w) for _ in range(copies(nbytes(0, k, n)) - 1)]


def bench_linear(name, k, n, awq, tune, deadline, log):
    qweight, scales, qzeros = random_int4(k, n)
    ws = rotated(prepare_kernel_weights(qweight, scales, qzeros, GS), k, n)   # what the engine loads
    tune_ws = rotated(prepare_w4a16(qweight, scales, qzeros, GS), k, n) if tune else []   # row-layout kernels
    w, g, rot = ws[0], k // GS, len(ws)

    def ints(*shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int32, device=DEV)
    dense = [torch.randn(k, n, dtype=torch.float16, device=DEV) * 0.02 for _ in range(copies(k * n * 2))]
    tiny = tiny_err = None
    try:
        tiny = [(torch.ops.aten._convert_weight_to_int4pack(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV), 8),
            torch.rand(g, n, 2, dtype=torch.bfloat16, device=DEV) * 0.01) for _ in range(rot)]
    except Exception as e:
        tiny_err = repr(e)[:300]
    awq_ws = [(ints(k, n // 8), scales.clone(), ints(g, n // 8)) for _ in range(rot)] if awq is not None else []
    dense_ref = dequantize_w4(qweight, scales, qzeros, GS, torch.float32)   # the twin, for a correctness check
    rows = []
    for m in MS:
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        ref = x.float() @ dense_ref
        err = ((w4a16_forward(x, w).float() - ref).norm() / ref.norm()).item()
        runs = alternating_us({"fp16": [lambda d=d: torch.mm(x, d) for d in dense],
                               "ours": [lambda w=w: w4a16_forward(x, w) for w in ws]})
        row = {"m": m, "ours_rel_err": err, "fp16_us": median(runs["fp16"]), "ours_us": median(runs["ours"]),
               "fp16_runs_us": runs["fp16"], "ours_runs_us": runs["ours"],
               "fp16_dobench_us": us(lambda: torch.mm(x, dense[0])), "ours_config": ours_config(w, m, k, n)}
        if m <= 128 and pdl_enabled(x):      # the same calls launched without PDL (kernels/pdl.py), for the record
            options = runtime_for(x.device).options
            configure(x.device, dataclasses.replace(options, pdl=False))
            row["ours_no_pdl_us"] = graph_us([lambda w=w: w4a16_forward(x, w) for w in ws])
            configure(x.device, options)
        if m >= 64 and isinstance(w, FragWeights):   # the alternative: dequantize once a call, then cuBLAS
            row["dequant_us"] = graph_us([lambda w=w: torch.mm(x, frag_dequantize(w).t()) for w in ws])
        if tiny is not None:
            xb = x.bfloat16()
            timed(row, "tinygemm", [lambda t=t: torch.ops.aten._weight_int4pack_mm(xb, t[0], GS, t[1]) for t in tiny])
        elif tiny_err:
            row["tinygemm_error"] = tiny_err
        if awq is not None:
            if m >= 1024:      # WQLinear_GEMM's own switch: dequantize + matmul from 1024 tokens
                fns = [lambda a=a: torch.matmul(x, awq.awq_dequantize_triton(*a)) for a in awq_ws]
            else:
                fns = [lambda a=a: awq.awq_gemm_triton(x, *a, split_k_iters=8) for a in awq_ws]
            timed(row, "awq", fns)
        if tune and m in TUNE_MS:
            row["tune"], best = tune_point(x, tune_ws, m, k, n, deadline, ref)
            if best is not None:
                row["tuned_us"], row["tuned_config"], row["tuned_pack_k"] = best["us"], best["config"], best["pack_k"]
        for key in ("fp16", "ours", "tinygemm", "awq", "tuned"):
            if f"{key}_us" in row:
                row[f"{key}_TBps"] = nbytes(m, k, n, key != "fp16") / row[f"{key}_us"] / 1e6
        rows.append(row)
        log(f"{name:8s} M={m:5d} fp16 {row['fp16_us']:8.1f}  ours {row['ours_us']:8.1f}  "
            f"tuned {row.get('tuned_us', float('nan')):8.1f}  tinygemm {row.get('tinygemm_us', float('nan')):8.1f}  "
            f"awq {row.get('awq_us', float('nan')):8.1f}  fp16 eager {row['fp16_dobench_us']:8.1f}  err {err:.1e}")
    return rows


def config_us(call, sets, must_run: bool) -> float:
    """GPU time of call(kv) over the rotated sets; a tuning candidate that cannot compile or launch is inf."""
    try:
        return graph_us([lambda kv=kv: call(kv) for kv in sets])
    except Exception:                              # noqa: BLE001 (resources: shared memory, registers)
        if must_run:
            raise
        torch.cuda.synchronize()
        return float("inf")


def bench_decode(tune, log):
    """Qwen2.5-7B attention (28 q heads, 4 kv heads, head_dim 128), one decode token per sequence."""
    hq, hkv, d, bs = 28, 4, 128, 16
    rows = []
    configs = [None]
    if tune:
        configs += [DecodeConfig(block_n=bn, num_stages=st, waves=wv, min_split_tokens=mt, fp8_asm=asm)
                    for asm in (False, True) for bn in (64, 128, 256) for st in (2, 3)
                    for wv, mt in ((2.0, 256), (4.0, 128), (8.0, 64))]
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CTXS:
            nblk = ctx // bs
            tables = torch.randperm(batch * nblk, device=DEV).view(batch, nblk).to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
            q = torch.randn(batch, hq, d, dtype=torch.float16, device=DEV)
            scale = torch.tensor(1.0, device=DEV)
            row = {"batch": batch, "ctx": ctx}
            dtypes = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}
            kv_sets = {tag: [(torch.randn(batch * nblk, bs, hkv, d, device=DEV).to(dtype),
                              torch.randn(batch * nblk, bs, hkv, d, device=DEV).to(dtype))
                             for _ in range(copies(2 * batch * ctx * hkv * d * dtype.itemsize))]
                       for tag, dtype in dtypes.items()}

            def decode_call(kv, c=None):
                return paged_decode(q, *kv, tables, lens, qsl, d ** -0.5, scale, scale, *([c] if c else []))
            # the default configuration of both caches in turn, three times (the fp8 / fp16 ratio is the goal)
            runs = alternating_us({tag: [lambda kv=kv: decode_call(kv) for kv in sets]
                                   for tag, sets in kv_sets.items()})
            for tag, dtype in dtypes.items():
                row[f"{tag}_us"], row[f"{tag}_runs_us"] = median(runs[tag]), runs[tag]
                row[f"{tag}_TBps"] = 2 * batch * ctx * hkv * d * dtype.itemsize / row[f"{tag}_us"] / 1e6
                if tune:
                    cands = [c for c in configs[1:] if tag == "fp8" or not c.fp8_asm]   # asm: fp8 tiles only
                    times = [config_us(lambda kv, c=c: decode_call(kv, c), kv_sets[tag], False) for c in cands]
                    row[f"{tag}_all"] = [dict(dataclasses.asdict(c), us=t) for c, t in zip(cands, times)]
                    i = min(range(len(times)), key=times.__getitem__)
                    best = times[i] < row[f"{tag}_us"]
                    row[f"{tag}_tuned_us"] = times[i] if best else row[f"{tag}_us"]
                    row[f"{tag}_tuned_config"] = dataclasses.asdict(cands[i]) if best else "default"
            del kv_sets
            sdpa = torch.nn.functional.scaled_dot_product_attention
            qd = q.view(batch, hq, 1, d)
            sets = [(torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device=DEV),
                     torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device=DEV))
                    for _ in range(copies(4 * batch * ctx * hkv * d))]
            timed(row, "sdpa", [lambda kv=kv: sdpa(qd, *kv, enable_gqa=True) for kv in sets])
            del sets
            rows.append(row)
            log(f"decode B={batch:4d} ctx={ctx:5d} fp16 {row['fp16_us']:8.1f} fp8 {row['fp8_us']:8.1f} "
                f"sdpa {row.get('sdpa_us', float('nan')):8.1f}  tuned fp16 {row.get('fp16_tuned_us', 0):8.1f} "
                f"fp8 {row.get('fp8_tuned_us', 0):8.1f}")
    return rows


def summarize(linear, decode):
    def total(key, m):
        vals = [next(r for r in rows if r["m"] == m).get(f"{key}_us") for rows in linear.values()]
        return None if None in vals else sum(vals)

    out = {}
    for key in ("ours", "ours_no_pdl", "tuned", "tinygemm", "awq"):
        s = {}
        for m in (1, 16, 64):
            t = total(key, m)
            s[f"speedup_m{m}"] = None if t is None else total("fp16", m) / t
        ratios = [r[f"{key}_us"] / r["fp16_us"] for rows in linear.values() for r in rows
                  if r["m"] >= 256 and f"{key}_us" in r]
        s["worst_ratio_m256_plus"] = max(ratios) if ratios else None
        out.update(s) if key == "ours" else out.setdefault(key, s)
    out["ours_rel_err_max"] = max(r["ours_rel_err"] for rows in linear.values() for r in rows)
    out["goals"] = {"speedup_m1": 3.3, "speedup_m16": 2.5, "speedup_m64": 1.5, "worst_ratio_m256_plus": 1.1}
    out.update(summarize_decode(decode))
    return out


def summarize_decode(decode) -> dict:
    out = {}
    fp8 = [r["fp8_us"] / r["fp16_us"] for r in decode]
    out["decode_fp8_over_fp16_worst"] = max(fp8)
    out["decode_fp8_over_fp16_mean"] = sum(fp8) / len(fp8)
    sd = [r["fp16_us"] / r["sdpa_us"] for r in decode if "sdpa_us" in r]
    out["decode_ours_fp16_over_sdpa_mean"] = sum(sd) / len(sd) if sd else None
    tuned = [r["fp8_tuned_us"] / r["fp16_tuned_us"] for r in decode if "fp8_tuned_us" in r]
    if tuned:
        out["decode_tuned_fp8_over_fp16_worst"] = max(tuned)
    return out


def bench_gguf_formats(formats: list[str], shapes: dict, result: dict, sms: int, out: str, log) -> None:
    """--weights: each GGUF format's planned kernel against FP16 cuBLAS on SHAPES x MS, saved after each format."""
    from gguf_kernel_speed import FORMATS, bench_format, summarize   # a sibling script (bench/ is on sys.path)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown --weights {unknown}: choose from awq, {', '.join(FORMATS)}")
    result["weights"] = formats
    result["shapes"] = shapes
    result["gguf"] = {}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for fmt in formats:
        result["gguf"][fmt] = bench_format(fmt, shapes, MS, graph_us, copies, sms, log)
        result["summary"] = summarize(result["gguf"])
        Path(out).write_text(json.dumps(result, indent=1))
    log(json.dumps(result["summary"], indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernels-h200.json")
    ap.add_argument("--awq-sdist", default="")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new tuning points after this")
    ap.add_argument("--no-decode", action="store_true", help="skip the attention section (tuning runs)")
    ap.add_argument("--ms", default="", help="comma-separated M list (default: all)")
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help=f"comma-separated layers of Qwen2.5-7B for --weights: {', '.join({**SHAPES, **MORE_SHAPES})}")
    ap.add_argument("--decode-only", action="store_true", help="only the attention section")
    ap.add_argument("--tune-decode", action="store_true",
                    help="also time decode configurations around the defaults (the *_tuned_* keys)")
    ap.add_argument("--profile", default="this", choices=PROFILE_NAMES,
                    help="GPU profile the kernel plans assume (kernels/gpu.py); default: the device itself")
    ap.add_argument("--weights", default="awq",
                    help="awq (the W4A16 g128 zero-point run above) or a comma-separated list of GGUF formats: "
                         "gguf-q4_0, gguf-q4_1, gguf-q4_k, gguf-q4_k-f16, awq-g128, gguf-q6_k, gguf-q6_k-frag, gguf-q5_k, gguf-q5_k-frag, q8_0, "
                         "q6_k, q5_k (bench/gguf_kernel_speed.py)")
    args = ap.parse_args()
    caps = configure(0, KernelOptions(profile=args.profile)).caps
    if args.ms:
        MS[:] = [int(v) for v in args.ms.split(",")]
    start = time.time()
    log = print
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip() if git.returncode == 0 else "uncommitted"
    result = {"command": " ".join(sys.argv), "git_commit": commit, "gpu": torch.cuda.get_device_name(),
              "profile": args.profile, "gpu_family": caps.family, "sms": caps.sms,
              "smem_per_block": caps.smem_per_block, "tma": caps.tma, "wgmma": caps.wgmma, "pdl": caps.pdl,
              "torch": torch.__version__,
              "triton": triton.__version__, "group_size": GS,
              "timer": "us per call, CUDA-graph replay over rotated weights (median of 5); fp16 and ours, and fp16 "
                       "and fp8 decode: the median of three such readings taken in turn (*_runs_us); *_dobench_us: "
                       "do_bench"}
    result["copy_TBps"] = copy_bandwidth()
    log(f"{result['gpu']}: copy {result['copy_TBps']:.2f} TB/s")
    if args.weights != "awq":
        known = {**SHAPES, **MORE_SHAPES}
        bad = [name for name in args.shapes.split(",") if name not in known]
        if bad:
            raise SystemExit(f"unknown --shapes {bad}: choose from {', '.join(known)}")
        shapes = {name: known[name] for name in args.shapes.split(",")}
        bench_gguf_formats(args.weights.split(","), shapes, result, caps.sms, args.out, log)
        return
    awq = load_awq(args.awq_sdist)
    deadline = start + args.budget_s
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["linear"] = {}
    result["table_rows"] = {}
    for name, (k, n) in ({} if args.decode_only else SHAPES).items():   # saved after every section
        result["linear"][name] = bench_linear(name, k, n, awq, args.tune, deadline, log)
        winners = [(r["m"], W4A16Config(**r["tuned_config"])) for r in result["linear"][name] if "tuned_config" in r]
        if winners:
            result["table_rows"][name] = table_row(k, n, winners)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if result["table_rows"]:
        log("tuning-table rows (kernels/matmul/rules.py, _SM90['shapes']):")
        for name, text in result["table_rows"].items():
            log(f"    {text}  # {name}")
    if args.no_decode:
        result["wall_s"] = time.time() - start
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    result["decode"] = bench_decode(args.tune_decode, log)
    result["summary"] = summarize(result["linear"], result["decode"]) if result["linear"] else \
        summarize_decode(result["decode"])
    result["wall_s"] = time.time() - start
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
