"""W4A8 (int8 activations, kernels/w4a8) against FP16 cuBLAS and the W4A16 plan, per GPU profile, on the layer shapes
of Qwen2.5-7B and Llama-3.1-8B (INT4 g128 with zero points, fragment layout), M in 1, 16, 64, 256, 1024, 4096.

Each profile runs in a fresh process (kernels/gpu.py configure; a profile on the H100 runs that card's plan: no TMA,
wgmma or PDL, its SM count and shared memory). Paths: "fp16" (cuBLAS on a dense weight), "w4a16" (the plan with
activation_dtype fp16), "w4a8" (the plan with activation_dtype int8: quantize kernel + int8 matmul, both timed),
"plan" (activation_dtype auto: whichever of the two the plan picks, its time), "expected" (the path that the
not yet measured bands of kernels/matmul/int8/rules.py W4A8_EXPECTED_M would pick, from the same readings) and "best" (the
faster of w4a16 and w4a8 at each point: what a perfect band rule would give). Before timing, w4a16 is checked
against the exact dequantized weights and w4a8 against its twin (w4a8_matmul_ref) on the first 64 rows. Times are
kernel_speed.py's: CUDA-graph replay over rotated weight copies (>= 256 MB), median of 5 replays, the three paths
read three times in turn and the median taken. --sweep also times W4A8 tiles around the rule's (one reading each).

  python bench/w4a8_speed.py --profiles this,a10,4090 --out bench/results/kernels-w4a8-h100.json [--sweep]
"""
import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))       # kernel_speed.py beside this file: its timer
from kernel_speed import alternating_us, copies, graph_us, random_int4, rotated  # noqa: E402
from quant_serve.kernels.gpu import KernelOptions, configure  # noqa: E402
from quant_serve.kernels.precompile import parallel_compile  # noqa: E402
from quant_serve.kernels.matmul.dispatch import _frag_forward  # noqa: E402
from quant_serve.kernels.matmul.frag.layout import prepare_frag  # noqa: E402
from quant_serve.kernels.matmul.plan import plan_w4a16
from quant_serve.kernels.matmul.probes import probed_runtime
from quant_serve.kernels.matmul.reference import dequantize_w4  # noqa: E402
from quant_serve.kernels.matmul.frag.tma import tma_works_for  # noqa: E402
from quant_serve.kernels.matmul.int8.quant import quantize_act  # noqa: E402
from quant_serve.kernels.matmul.reference_int8 import w4a8_matmul_ref  # noqa: E402
from quant_serve.kernels.matmul.int8.rules import W4A8_EXPECTED_M, W4A8Config  # noqa: E402

MODELS = {"qwen2.5-7b": {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)},
          "llama-3.1-8b": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}}
MS = [1, 16, 64, 256, 1024, 4096]
SWEEP_MS = (256, 4096)
PATHS = ("fp16", "w4a16", "w4a8", "plan", "expected", "best")
GS, CHECK_ROWS, DEV = 128, 64, "cuda"


def rel(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def sweep_configs(m: int, rule: W4A8Config) -> list[W4A8Config]:
    """W4A8 tiles beside the rule's: per-token scales, x rows split between two warps, twice the K splits, 64 x
    rows (above 64 rows), 64 weight rows of 4 warps."""
    out = {dataclasses.replace(rule, act_scale="token"), dataclasses.replace(rule, split_k=2 * rule.split_k),
           dataclasses.replace(rule, block_n=64, num_warps=4) if rule.block_m <= 64 else
           dataclasses.replace(rule, block_m=64)}
    if rule.block_m >= 64:
        out.add(dataclasses.replace(rule, warps_m=2))
    out.discard(rule)
    return sorted(out, key=repr)


def caps_family() -> str:
    return probed_runtime(torch.device(DEV)).caps.family


def layer_plans(x, fw, k, n, options) -> dict:
    """The W4A16 plan, the W4A8 plan (activation_dtype int8) and the auto plan of this call."""
    caps = probed_runtime(torch.device(DEV)).caps
    return {name: plan_w4a16(x.shape[0], k, n, caps, dataclasses.replace(options, activation_dtype=dtype), "frag",
                             torch.float16, False, tma_works_for(x, fw))
            for name, dtype in (("w4a16", "fp16"), ("w4a8", "int8"), ("plan", "auto"))}


def precompile(options, sweep: bool) -> None:
    """Every kernel the timed calls reach, compiled on 16 threads first (kernels/precompile.py); a failure here
    leaves the compile (and its error) to the timed pass."""
    try:
        _precompile(options, sweep)
    except Exception as e:                          # noqa: BLE001
        print(f"precompile: {e!r}"[:400])
    torch.cuda.synchronize()


def _precompile(options, sweep: bool) -> None:
    with parallel_compile(16):
        for shapes in MODELS.values():
            for k, n in shapes.values():
                fw = prepare_frag(*random_int4(k, n), GS)
                for m in MS:
                    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
                    plans = layer_plans(x, fw, k, n, options)
                    cfgs = [plans["w4a16"].config, plans["w4a8"].config]
                    cfgs += sweep_configs(m, plans["w4a8"].config) if sweep and m in SWEEP_MS else []
                    for cfg in cfgs:
                        _frag_forward(x, fw, None, cfg, False)
                del fw


def bench_layer(k, n, options, log, sweep: bool) -> list[dict]:
    raw = random_int4(k, n)
    ws = rotated(prepare_frag(*raw, GS), k, n)
    dense = [torch.randn(k, n, dtype=torch.float16, device=DEV) * 0.02 for _ in range(copies(k * n * 2))]
    exact = dequantize_w4(*raw, GS, torch.float32)
    rows = []
    for m in MS:
        x = torch.randn(m, k, dtype=torch.float16, device=DEV)
        plans = layer_plans(x, ws[0], k, n, options)
        xs = x[:CHECK_ROWS]
        twin = w4a8_matmul_ref(xs.float(), raw[0], raw[1].float(), raw[2], GS, GS)
        exact_y = xs.float() @ exact
        row = {"m": m, **{f"{p}_kernel": plans[p].kernel for p in plans},
               **{f"{p}_config": repr(plans[p].config) for p in plans}, "plan_why": plans["plan"].why}

        def call(cfg):
            return lambda w: _frag_forward(x, w, None, cfg, False)
        fns = {"fp16": [lambda d=d: torch.mm(x, d) for d in dense],
               "w4a16": [lambda w=w: call(plans["w4a16"].config)(w) for w in ws],
               "w4a8": [lambda w=w: call(plans["w4a8"].config)(w) for w in ws]}
        row["w4a16_rel_err"] = rel(call(plans["w4a16"].config)(ws[0])[:CHECK_ROWS], exact_y)
        try:
            y8 = call(plans["w4a8"].config)(ws[0])[:CHECK_ROWS]
            row["w4a8_rel_err_twin"], row["w4a8_rel_err_exact"] = rel(y8, twin), rel(y8, exact_y)
        except Exception as e:                      # noqa: BLE001 - recorded; fp16 and w4a16 are still timed
            row["w4a8_error"], row["w4a8_rel_err_twin"], row["w4a8_rel_err_exact"] = repr(e)[:400], None, None
            del fns["w4a8"]
        # a wrong result is timed and flagged (one device call: the readings are kept to find where it breaks)
        row["wrong"] = not (row["w4a16_rel_err"] < 2e-3 and (row["w4a8_rel_err_twin"] or 0.0) < 1e-3)
        runs = alternating_us(fns)
        for p, t in runs.items():
            row[f"{p}_us"], row[f"{p}_runs_us"] = median(t), t
        row.setdefault("w4a8_us", None)
        row["plan_us"] = row["w4a8_us"] if plans["plan"].kernel == "w4a8" else row["w4a16_us"]
        lo, hi = W4A8_EXPECTED_M.get(caps_family(), (1 << 30, 0))
        row["expected_us"] = row["w4a8_us"] if lo <= m <= hi else row["w4a16_us"]
        row["best_us"] = min(t for t in (row["w4a16_us"], row["w4a8_us"]) if t is not None)
        kp = ws[0].words.shape[1] // 2
        row["w4a8_quant_us"] = graph_us([lambda: quantize_act(x, kp, GS)])
        if sweep and m in SWEEP_MS and "w4a8_error" not in row:
            row["w4a8_sweep"] = []
            for cfg in sweep_configs(m, plans["w4a8"].config):
                ag = k if cfg.act_scale == "token" else GS
                ref = twin if ag == GS else w4a8_matmul_ref(xs.float(), raw[0], raw[1].float(), raw[2], GS, k)
                try:
                    err = rel(call(cfg)(ws[0])[:CHECK_ROWS], ref)
                    t = graph_us([lambda w=w, c=cfg: call(c)(w) for w in ws])
                    row["w4a8_sweep"].append({"config": dataclasses.asdict(cfg), "us": t, "rel_err_twin": err})
                except Exception as e:              # noqa: BLE001
                    row["w4a8_sweep"].append({"config": dataclasses.asdict(cfg), "error": repr(e)[:300]})
        rows.append(row)
        log(f"K={k:5d} N={n:5d} M={m:5d} fp16 {row['fp16_us']:8.1f}  w4a16 {row['w4a16_us']:8.1f} "
            f"({plans['w4a16'].kernel})  w4a8 {row['w4a8_us'] or float('nan'):8.1f} (quant "
            f"{row['w4a8_quant_us']:.1f})  plan {plans['plan'].kernel}  err twin {row['w4a8_rel_err_twin']} exact "
            f"{row['w4a8_rel_err_exact']}{'  WRONG' if row['wrong'] else ''}")
    return rows


def summarize(layers: dict) -> dict:
    """Per model and over both: speedup_m{M} = summed FP16 time / summed path time; worst_ratio_m256_plus = the
    largest path / FP16 time of any layer at M >= 256; for each path."""
    out = {}
    groups = {**{model: [r for name, r in layers.items() if name.startswith(model + ":")] for model in MODELS},
              "both": list(layers.values())}
    for group, layer_rows in groups.items():
        out[group] = {}
        for path in PATHS[1:]:
            def total(key, m):
                vals = [next(r for r in rows if r["m"] == m)[key] for rows in layer_rows]
                return None if None in vals else sum(vals)
            s = {f"speedup_m{m}": total(f"{path}_us", m) and total("fp16_us", m) / total(f"{path}_us", m)
                 for m in MS}
            ratios = [r[f"{path}_us"] / r["fp16_us"] for rows in layer_rows for r in rows
                      if r["m"] >= 256 and r[f"{path}_us"] is not None]
            s["worst_ratio_m256_plus"] = max(ratios) if ratios else None
            out[group][path] = s
        out[group]["wrong_rows"] = sum(r["wrong"] for rows in layer_rows for r in rows)
    return out


def run_profile(profile: str, sweep: bool, part: Path) -> dict:
    """One profile's readings, written to `part` after every layer (a run cut short keeps what it has)."""
    options = KernelOptions(profile=profile)
    caps = configure(0, options).caps
    probed_runtime(torch.device(DEV))             # the device's probes, before launches only compile
    start = time.time()
    precompile(options, sweep)
    result = {"profile": profile, "gpu_family": caps.family, "sms": caps.sms, "smem_per_block": caps.smem_per_block,
              "tma": caps.tma, "wgmma": caps.wgmma, "pdl": caps.pdl, "compile_s": time.time() - start, "layers": {}}
    for model, shapes in MODELS.items():
        for layer, (k, n) in shapes.items():
            result["layers"][f"{model}:{layer}"] = bench_layer(k, n, options, print, sweep)
            torch.cuda.empty_cache()
            part.write_text(json.dumps(result))
    result["summary"] = summarize(result["layers"])
    part.write_text(json.dumps(result))
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="this,a10,4090")
    ap.add_argument("--out", default="bench/results/kernels-w4a8-h100.json")
    ap.add_argument("--sweep", default="", help="profiles whose run also times the W4A8 tiles around the rule's")
    ap.add_argument("--budget-s", type=float, default=3600, help="stop (keeping whole layers) after this")
    ap.add_argument("--commit", default="", help="the tree's commit where the checkout's git cannot tell")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)           # a child process: one profile
    args = ap.parse_args()
    if args.one:
        run_profile(args.one, args.one in args.sweep.split(","), Path(args.out))
        return
    start = time.time()
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = args.commit or (git.stdout.strip() if git.returncode == 0 else "unknown")
    result = {"command": " ".join(sys.argv), "git_commit": commit,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "group_size": GS,
              "timer": "us per call, CUDA-graph replay over rotated weights (median of 5); fp16, w4a16 and w4a8 read "
                       "three times in turn, the median of each (*_runs_us); w4a8 includes the quantize kernel "
                       "(w4a8_quant_us alone); plan_us is the picked path's time", "profiles": {}}
    import triton
    result["triton"] = triton.__version__
    for profile in args.profiles.split(","):                 # each in a fresh process
        part = Path(args.out).with_suffix(f".{profile}.part")
        left = args.budget_s - (time.time() - start)
        if left < 20:
            break
        try:
            code = subprocess.run([sys.executable, __file__, "--one", profile, "--sweep", args.sweep, "--out",
                                   str(part)], timeout=left).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        result["profiles"][profile] = json.loads(part.read_text()) if part.exists() else {}
        if code != 0:
            result["profiles"][profile]["error"] = f"exit {code}: readings up to the last whole layer"
            if "layers" in result["profiles"][profile]:
                result["profiles"][profile]["summary"] = summarize(result["profiles"][profile]["layers"])
        part.unlink(missing_ok=True)
        result["wall_s"] = time.time() - start
        Path(args.out).write_text(json.dumps(result, indent=1))
    for profile, r in result["profiles"].items():
        for group, paths in r.get("summary", {}).items():
            for path, s in paths.items():
                if isinstance(s, dict):
                    print(f"{profile:5s} {group:12s} {path:6s} " + "  ".join(
                        f"{k.removeprefix('speedup_')} {v if v is None else round(v, 2)}" for k, v in s.items()))
                else:
                    print(f"{profile:5s} {group:12s} {path}: {s}")


if __name__ == "__main__":
    main()
