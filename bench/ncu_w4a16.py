"""Profile (GPU, Nsight Compute): hardware counters of the W4A16 kernels at chosen (layer, M, tile) points, next to
FP16 cuBLAS at the same point: where a kernel's time goes (tensor pipe, shared memory, DRAM, issue, warp stalls).
Runs itself under `ncu` (the profiled range is one eager call a case, after a warm-up that compiles) and writes the
counters as JSON. Needs a machine where ncu reads the hardware counters.

    PYTHONPATH=. python bench/ncu_w4a16.py --out bench/results/ncu-w4a16-h200.json [--cases 'gate_up:64:tma:2,256,64;qkv:1:ours']

A case is layer:M:path[:consumers,block_n,block_m[,overlap]]: path `fp16` (cuBLAS), `ours` (the dispatcher) or
`tma` (kernels/matmul/frag/tma.py with that tile). --source: where in the code the warps wait instead (the source
counters' stall samples by SASS line): each kernel's stall shares by reason and its most-sampled lines, e.g.

    PYTHONPATH=. python bench/ncu_w4a16.py --source --cases 'gate_up:16:ours;gate_up:8:ours' \
        --out bench/results/ncu-m16-source-h200.json
"""
import argparse
import collections
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


CASES = ["gate_up:1:ours", "gate_up:1:fp16", "down:1:ours", "qkv:1:ours", "gate_up:16:ours", "down:16:ours",
         "gate_up:64:tma:2,256,64", "gate_up:64:tma:1,128,64", "gate_up:64:tma:1,128,64,overlap",
         "gate_up:64:fp16", "down:64:tma:1,128,64",
         "qkv:256:tma:1,64,128", "qkv:256:tma:1,64,128,overlap", "qkv:256:tma:2,128,256", "qkv:256:fp16", "gate_up:1024:tma:2,128,256",
         "gate_up:1024:fp16"]
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "SchedulerStats",
            "WarpStateStats", "Occupancy", "LaunchStats"]
# warp stall reasons (cycles a warp spends per issued instruction, by reason) and the pipes' activity
METRICS = [r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
           r"regex:sm__pipe_.*tensor.*cycles_active\.avg\.pct_of_peak_sustained_active",
           r"regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active",
           "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
           "dram__bytes_read.sum", "lts__t_bytes.sum"]


def run_cases(cases: list[str]):
    """The worker (under ncu): each case warmed up, then one call inside the profiled range."""
    import torch
    from bench.kernel_speed import SHAPES, random_int4, GS
    from quant_serve.kernels.matmul.dispatch import w4a16_forward
    from quant_serve.kernels.matmul.frag.layout import prepare_frag
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    layers = {}
    for case in cases:
        name, m, path, *tile = case.split(":")
        k, n = SHAPES[name]
        if name not in layers:
            raw = random_int4(k, n)
            layers[name] = (prepare_frag(*raw, GS), torch.randn(k, n, dtype=torch.float16, device="cuda") * 0.02)
        fw, dense = layers[name]
        x = torch.randn(int(m), k, dtype=torch.float16, device="cuda")
        if path == "fp16":
            fn = lambda: torch.mm(x, dense)                                        # noqa: E731
        elif path == "ours":
            fn = lambda: w4a16_forward(x, fw)                                      # noqa: E731
        else:
            cons, bn, bm, *flags = tile[0].split(",")
            cfg = dict(consumers=int(cons), block_n=int(bn), block_m=int(bm), overlap="overlap" in flags)
            fn = lambda: w4a16_tma(x, fw, **cfg)                                   # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(case)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()


def parse(text: str) -> list[dict]:
    """ncu's --csv --page details output -> one entry a profiled kernel: {case, kernel, metrics {section: {name:
    value unit}}} in launch order (a case's range holds one kernel or more: the stream-K reduce, cuBLAS's)."""
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels = {}
    for row in rows:
        nvtx = next((v for key, v in row.items() if key and "nvtx" in key.lower() and v), "")
        entry = kernels.setdefault(row["ID"], {"kernel": row["Kernel Name"][:120], "nvtx": nvtx, "metrics": {}})
        sec = entry["metrics"].setdefault(row["Section Name"], {})
        sec[row["Metric Name"]] = f'{row["Metric Value"]} {row["Metric Unit"]}'.strip()
    return [kernels[i] for i in sorted(kernels, key=int)]


def summarize_source(source_csv: str, top: int) -> list[dict]:
    """ncu's --page source --csv output (a block a kernel, in launch order) -> per kernel: stall shares by reason
    (% of all samples) and the `top` most-sampled SASS lines with their reasons (5 samples or more)."""
    out = []
    for block in source_csv.split('"Kernel Name"')[1:]:
        lines = block.splitlines()
        table = list(csv.reader(io.StringIO("\n".join(lines[1:]))))
        head, rows = table[0], [r for r in table[1:] if len(r) == len(table[0])]
        col = {h: i for i, h in enumerate(head)}
        reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
        shares = collections.Counter()
        for r in rows:
            for h in reasons:
                shares[h[6:]] += float(r[col[h]] or 0)
        total = sum(shares.values()) or 1.0
        samples = "Warp Stall Sampling (All Samples)"
        ranked = sorted(rows, key=lambda r: -float(r[col[samples]] or 0))[:top]
        out.append({"kernel": lines[0].strip(',"'), "samples": total,
                    "stall_share_pct": {k: round(v / total * 100, 1) for k, v in shares.most_common() if v},
                    "top_lines": [{"sass": r[col["Source"]].strip(),
                                   "share_pct": round(float(r[col[samples]] or 0) / total * 100, 1),
                                   "reasons": {h[6:]: float(r[col[h]]) for h in reasons if float(r[col[h]] or 0) >= 5}}
                                  for r in ranked]})
    return out


def profile_source(ncu: str, cases: str, top: int) -> list[dict]:
    """The cases under the source counters (a report file, exported by SASS line, then deleted)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([ncu, "--profile-from-start", "off", "--section", "SourceCounters", "--section",
                        "WarpStateStats", "-o", f"{tmp}/rep", sys.executable, __file__, "--worker", "--cases", cases],
                       check=True, env=dict(os.environ, TRITON_INTERPRET="0"))
        source = subprocess.run([ncu, "-i", f"{tmp}/rep.ncu-rep", "--page", "source", "--csv", "--print-source",
                                 "sass"], check=True, capture_output=True, text=True).stdout
    return summarize_source(source, top)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/ncu-w4a16-h200.json")
    ap.add_argument("--cases", default=";".join(CASES), help="cases separated by ';'")
    ap.add_argument("--raw", default="", help="also write ncu's CSV here")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--source", action="store_true", help="stall samples by SASS line instead of the sections")
    ap.add_argument("--top", type=int, default=10, help="--source: most-sampled lines kept a kernel")
    args = ap.parse_args()
    cases = args.cases.split(";")
    if args.worker:
        return run_cases(cases)
    ncu = shutil.which("ncu") or max(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), default="ncu")
    if args.source:
        import torch
        version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "ncu": version[-1:],
                  "cases": cases, "kernels": profile_source(ncu, args.cases, args.top)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for k in result["kernels"]:
            print(k["kernel"][:40], k["stall_share_pct"], flush=True)
        return
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--csv", "--page", "details",
           *[a for s in SECTIONS for a in ("--section", s)], "--metrics", ",".join(METRICS),
           sys.executable, __file__, "--worker", "--cases", args.cases]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"))
    if proc.returncode or '"ID"' not in proc.stdout:
        raise SystemExit(f"ncu failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if args.raw:
        Path(args.raw).write_text(proc.stdout)
    import torch
    result = {"command": " ".join(sys.argv), "ncu": " ".join(cmd[:cmd.index(sys.executable)]),
              "gpu": torch.cuda.get_device_name(), "cases": cases, "kernels": parse(proc.stdout),
              "wall_s": time.time() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k in result["kernels"]:
        sol = k["metrics"].get("GPU Speed Of Light Throughput", {})
        print(k["nvtx"], k["kernel"][:40], sol.get("Duration"), "SM", sol.get("Compute (SM) Throughput"),
              "DRAM", sol.get("DRAM Throughput"), flush=True)


if __name__ == "__main__":
    main()
