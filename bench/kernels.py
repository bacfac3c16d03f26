"""Kernel benchmarks on one GPU, anchors measured in the same run (see ../shared/docs/targets.md).

W4A16 (g128, zero points) on the Qwen2.5-7B layer shapes: FP16 cuBLAS, our dispatcher, torch tinygemm int4 and
AutoAWQ 0.2.9's Triton GEMM (imported by file path from the sdist given with --awq-sdist). Paged decode attention:
fp16 vs fp8 e4m3 KV, and torch SDPA on an unpaged fp16 cache. Times are triton.testing.do_bench medians in us;
do_bench zeroes a 256 MB buffer before every run, so no input is served from L2 (no rotation needed).
--tune also times the search space of kernels/w4a16_tuning.py and decode configs, for the tables in kernels/.

  PYTHONPATH=. python bench/kernels.py --out bench/results/kernels-h200.json [--tune] [--awq-sdist F.tar.gz]
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

# this file is named kernels.py: its folder must not shadow the repository's kernels package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels.paged_attention import DecodeConfig, paged_decode  # noqa: E402
from kernels.w4a16 import prepare_w4a16, w4a16_forward  # noqa: E402
from kernels.w4a16_tuning import (W4A16Config, candidate_configs, gpu_family, refinements,  # noqa: E402
                                  select_config)

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
TUNE_MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
DECODE_BATCHES, DECODE_CTXS = (1, 4, 16, 64, 256), (512, 2048, 8192)
GS = 128
DEV = "cuda"


def us(fn) -> float:
    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written, TB/s."""
    a = torch.empty(2 ** 31, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
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
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def int4_bytes(m, k, n):
    g = k // GS
    return k * n // 2 + g * n * 2 + g * n // 2 + m * k * 2 + m * n * 2


def fp16_bytes(m, k, n):
    return k * n * 2 + m * k * 2 + m * n * 2


def tune_point(x, w, m, k, n, w256, deadline):
    """Time every candidate, refine the winner; -> (list of {config, us}, best)."""
    rows = []

    def run(cfg, weights, tag=""):
        try:
            rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights.pack_k,
                         "us": us(lambda: w4a16_forward(x, weights, None, cfg)), "tag": tag})
        except Exception as e:                                   # a config the compiler rejects (resources)
            rows.append({"config": dataclasses.asdict(cfg), "pack_k": weights.pack_k, "error": repr(e)[:200]})

    for cfg in candidate_configs(m, k, n):
        if time.time() > deadline:
            break
        run(cfg, w)
    timed = [r for r in rows if "us" in r]
    if not timed:
        return rows, None
    best = min(timed, key=lambda r: r["us"])
    best_cfg = W4A16Config(**best["config"])
    for cfg in refinements(best_cfg):
        run(cfg, w, "refine")
    if best_cfg.path != "dequant":
        run(best_cfg, w256, "pack_k=256")
    timed = [r for r in rows if "us" in r]
    return rows, min(timed, key=lambda r: r["us"])


def bench_linear(name, k, n, awq, tune, deadline, log):
    g = k // GS
    qweight = torch.randint(-2 ** 31, 2 ** 31, (k // 8, n), dtype=torch.int32, device=DEV)
    scales = (torch.rand(g, n, device=DEV) * 0.01 + 0.001).half()
    qzeros = torch.randint(-2 ** 31, 2 ** 31, (g, n // 8), dtype=torch.int32, device=DEV)
    w = prepare_w4a16(qweight, scales, qzeros, GS)
    w256 = prepare_w4a16(qweight, scales, qzeros, GS, pack_k=256) if tune else None
    dense = torch.randn(k, n, dtype=torch.float16, device=DEV) * 0.02
    tiny = tiny_err = None
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack(
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV), 8)
        tiny = (packed, torch.rand(g, n, 2, dtype=torch.bfloat16, device=DEV) * 0.01)
    except Exception as e:
        tiny_err = repr(e)[:300]
    if awq is not None:
        awq_w = (torch.randint(-2 ** 31, 2 ** 31, (k, n // 8), dtype=torch.int32, device=DEV),
                 scales, torch.randint(-2 ** 31, 2 ** 31, (g, n // 8), dtype=torch.int32, device=DEV))
    rows = []
    for m in MS:
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        row = {"m": m, "fp16_us": us(lambda: torch.mm(x, dense)),
               "ours_us": us(lambda: w4a16_forward(x, w)),
               "ours_config": dataclasses.asdict(select_config(m, k, n, x.device))}
        if tiny is not None:
            xb = x.bfloat16()
            row["tinygemm_us"] = us(lambda: torch.ops.aten._weight_int4pack_mm(xb, tiny[0], GS, tiny[1]))
        elif tiny_err:
            row["tinygemm_error"] = tiny_err
        if awq is not None:
            if m >= 1024:      # WQLinear_GEMM's own switch: dequantize + matmul from 1024 tokens
                fn = lambda: torch.matmul(x, awq.awq_dequantize_triton(*awq_w))  # noqa: E731
            else:
                fn = lambda: awq.awq_gemm_triton(x, *awq_w, split_k_iters=8)  # noqa: E731
            row["awq_us"] = us(fn)
        if tune and m in TUNE_MS:
            row["tune"], best = tune_point(x, w, m, k, n, w256, deadline)
            if best is not None:
                row["tuned_us"], row["tuned_config"], row["tuned_pack_k"] = best["us"], best["config"], best["pack_k"]
        for key in ("fp16", "ours", "tinygemm", "awq", "tuned"):
            if f"{key}_us" in row:
                size = fp16_bytes(m, k, n) if key == "fp16" else int4_bytes(m, k, n)
                row[f"{key}_TBps"] = size / row[f"{key}_us"] / 1e6
        rows.append(row)
        log(f"{name:8s} M={m:5d} fp16 {row['fp16_us']:8.1f}  ours {row['ours_us']:8.1f}  "
            f"tuned {row.get('tuned_us', float('nan')):8.1f}  tinygemm {row.get('tinygemm_us', float('nan')):8.1f}  "
            f"awq {row.get('awq_us', float('nan')):8.1f}")
    return rows


def bench_decode(tune, log):
    """Qwen2.5-7B attention (28 q heads, 4 kv heads, head_dim 128), one decode token per sequence."""
    hq, hkv, d, bs = 28, 4, 128, 16
    rows = []
    configs = [DecodeConfig()]
    if tune:
        configs += [DecodeConfig(block_n=bn, num_warps=nw, waves=wv, min_split_tokens=mt)
                    for bn in (32, 64, 128) for nw in (4,) for wv, mt in ((2.0, 256), (4.0, 128), (1.0, 512))
                    if (bn, nw, wv, mt) != (64, 4, 2.0, 256)]
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CTXS:
            nblk = ctx // bs
            tables = torch.randperm(batch * nblk, device=DEV).view(batch, nblk).to(torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
            q = torch.randn(batch, hq, d, dtype=torch.float16, device=DEV)
            row = {"batch": batch, "ctx": ctx}
            for tag, dtype in (("fp16", torch.float16), ("fp8", torch.float8_e4m3fn)):
                kc = torch.randn(batch * nblk, bs, hkv, d, device=DEV).to(dtype)
                vc = torch.randn(batch * nblk, bs, hkv, d, device=DEV).to(dtype)
                scale = torch.tensor(1.0, device=DEV)
                times = [us(lambda: paged_decode(q, kc, vc, tables, lens, qsl, d ** -0.5, scale, scale, c))
                         for c in configs]
                row[f"{tag}_us"] = times[0]
                row[f"{tag}_TBps"] = 2 * kc.numel() * kc.element_size() / times[0] / 1e6
                if tune:
                    i = min(range(len(times)), key=times.__getitem__)
                    row[f"{tag}_tuned_us"], row[f"{tag}_tuned_config"] = times[i], dataclasses.asdict(configs[i])
                del kc, vc
            kd = torch.randn(batch, hkv, ctx, d, dtype=torch.float16, device=DEV)
            vd = torch.randn_like(kd)
            qd = q.view(batch, hq, 1, d)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            row["sdpa_us"] = us(lambda: sdpa(qd, kd, vd, enable_gqa=True))
            del kd, vd
            rows.append(row)
            log(f"decode B={batch:4d} ctx={ctx:5d} fp16 {row['fp16_us']:8.1f} fp8 {row['fp8_us']:8.1f} "
                f"sdpa {row['sdpa_us']:8.1f}  tuned fp16 {row.get('fp16_tuned_us', 0):8.1f} "
                f"fp8 {row.get('fp8_tuned_us', 0):8.1f}")
    return rows


def summarize(linear, decode):
    def total(key, m):
        vals = [next(r for r in rows if r["m"] == m).get(f"{key}_us") for rows in linear.values()]
        return None if None in vals else sum(vals)

    out = {}
    for key in ("ours", "tuned", "tinygemm", "awq"):
        s = {}
        for m in (1, 16, 64):
            t = total(key, m)
            s[f"speedup_m{m}"] = None if t is None else total("fp16", m) / t
        ratios = [r[f"{key}_us"] / r["fp16_us"] for rows in linear.values() for r in rows
                  if r["m"] >= 256 and f"{key}_us" in r]
        s["worst_ratio_m256_plus"] = max(ratios) if ratios else None
        out.update(s) if key == "ours" else out.setdefault(key, s)
    out["goals"] = {"speedup_m1": 3.3, "speedup_m16": 2.5, "speedup_m64": 1.5, "worst_ratio_m256_plus": 1.1}
    fp8 = [r["fp8_us"] / r["fp16_us"] for r in decode]
    out["decode_fp8_over_fp16_worst"] = max(fp8)
    out["decode_fp8_over_fp16_mean"] = sum(fp8) / len(fp8)
    out["decode_ours_fp16_over_sdpa_mean"] = sum(r["fp16_us"] / r["sdpa_us"] for r in decode) / len(decode)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernels-h200.json")
    ap.add_argument("--awq-sdist", default="")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new tuning points after this")
    args = ap.parse_args()
    start = time.time()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        commit = "uncommitted"
    result = {"command": " ".join(sys.argv), "git_commit": commit, "gpu": torch.cuda.get_device_name(),
              "gpu_family": gpu_family(0)[0], "sms": gpu_family(0)[1], "torch": torch.__version__,
              "triton": triton.__version__, "group_size": GS, "timer": "triton.testing.do_bench median, us"}
    result["copy_TBps"] = copy_bandwidth()
    log(f"{result['gpu']}: copy {result['copy_TBps']:.2f} TB/s")
    awq = load_awq(args.awq_sdist)
    deadline = start + args.budget_s
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result["linear"] = {}
    for name, (k, n) in SHAPES.items():          # saved after every section: a killed run keeps what it measured
        result["linear"][name] = bench_linear(name, k, n, awq, args.tune, deadline, log)
        Path(args.out).write_text(json.dumps(result, indent=1))
    result["decode"] = bench_decode(args.tune, log)
    result["summary"] = summarize(result["linear"], result["decode"])
    result["wall_s"] = time.time() - start
    Path(args.out).write_text(json.dumps(result, indent=1))
    log(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
