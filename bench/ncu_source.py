"""Profile (GPU, Nsight Compute): where in the W4A16 kernel's code the warps wait. Runs itself under `ncu` with the
source counters (warp stall samples per SASS line), one dispatcher call per case after a warm-up that compiles, and
writes each kernel's stall shares by reason and its most-sampled lines as JSON (the raw report is deleted).

    PYTHONPATH=. python bench/ncu_source.py --out bench/results/ncu-m16-source-h200.json [--cases gate_up:16,gate_up:8]

A case is layer:M (the Qwen2.5-7B shapes of bench/kernels.py, random g128 weights with zero points).
"""
import argparse
import collections
import csv
import io
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def worker(cases: list[str]) -> None:
    import torch

    from bench.kernels import GS, SHAPES, random_int4
    from kernels.w4a16 import w4a16_forward
    from kernels.w4a16_frag import prepare_frag
    for case in cases:
        name, m = case.split(":")
        k, n = SHAPES[name]
        fw = prepare_frag(*random_int4(k, n), GS)
        x = torch.randn(int(m), k, dtype=torch.float16, device="cuda")
        for _ in range(3):
            w4a16_forward(x, fw)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(case)
        w4a16_forward(x, fw)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def summarize(source_csv: str, cases: list[str], top: int) -> list[dict]:
    """ncu's --page source CSV (one block a kernel) -> stall shares by reason and the most-sampled lines."""
    out = []
    blocks = source_csv.split('"Kernel Name"')[1:]
    for i, block in enumerate(blocks):
        kernel = block.splitlines()[0].strip(",\" ")
        case = cases[i] if len(blocks) == len(cases) else f"kernel {i}"      # a case of two kernels: by order
        table = list(csv.reader(io.StringIO("\n".join(block.splitlines()[1:]))))
        head, rows = table[0], [r for r in table[1:] if len(r) == len(table[0])]
        col = {h: i for i, h in enumerate(head)}
        reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
        shares = collections.Counter()
        for r in rows:
            for h in reasons:
                shares[h[6:]] += float(r[col[h]] or 0)
        total = sum(shares.values()) or 1.0
        samples = "Warp Stall Sampling (All Samples)"
        lines = sorted(rows, key=lambda r: -float(r[col[samples]] or 0))[:top]
        out.append({"case": case, "kernel": kernel, "samples": total,
                    "stall_share_pct": {k: round(v / total * 100, 1) for k, v in shares.most_common() if v},
                    "top_lines": [{"sass": r[col["Source"]].strip(),
                                   "share_pct": round(float(r[col[samples]] or 0) / total * 100, 1),
                                   "reasons": {h[6:]: float(r[col[h]]) for h in reasons if float(r[col[h]] or 0) >= 5}}
                                  for r in lines]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/ncu-m16-source-h200.json")
    ap.add_argument("--cases", default="gate_up:16,gate_up:8")
    ap.add_argument("--top", type=int, default=10, help="most-sampled SASS lines kept a kernel")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    cases = args.cases.split(",")
    if args.worker:
        worker(cases)
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    with tempfile.TemporaryDirectory() as tmp:
        rep = f"{tmp}/rep"
        include = [a for c in cases for a in ("--nvtx-include", f"{c}/")]
        subprocess.run([ncu, "--nvtx", *include, "--section", "SourceCounters", "--section", "WarpStateStats",
                        "-o", rep, sys.executable, __file__, "--worker", "--cases", args.cases], check=True)
        source = subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                                check=True, capture_output=True, text=True).stdout
        version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    import torch
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "ncu": version,
              "kernels": summarize(source, cases, args.top)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k in result["kernels"]:
        print(k["case"], k["stall_share_pct"])


if __name__ == "__main__":
    main()
