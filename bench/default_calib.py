"""The default calibration of `quant-serve quantize` without --calib (token windows sampled from the model itself,
engine/calib_samples.py) at several sizes, measured on the targets.md accuracy protocol (bench/quant_quality.py:
perplexity, KLD and top-1 against FP16 on held-out val.txt windows), with the seconds each size costs on the CPU.

    python bench/default_calib.py [--rows awq:128x512 awq:64x128 awq:64x128:s1 ...] [--threads 1]
                                  [--work /tmp/default-calib-cpu] [--out bench/results/default-calib-cpu-tiny-qwen2.json]

A row is METHOD:COUNTxLENGTH[:sSEED][:tTOKENS]: COUNT windows of LENGTH tokens sampled with --calib-seed SEED
(default 0), quantized with the CLI's defaults for METHOD (awq asym g128, gptq sym g128) on the CPU; tTOKENS sets
AWQSettings.search_tokens. The windows, checkpoints and per-row results are kept in --work, so that an interrupted
run resumes and more rows can be added later; every number in the output was measured by the run that wrote it
into --work (its seconds included).
"""
import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quant_serve.engine.calib_samples import sample_token_windows
from quant_serve.engine.load.loader import load_model_config
from quant_serve.quant.awq import AWQSettings
from quant_serve.quant.quantize import QuantizeConfig, quantize_model
from quant_serve.server.cli.quantize import load_source

_HERE = Path(__file__).resolve().parent


def _bench_module(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quant_quality = _bench_module("quant_quality")
TINY = quant_quality.TINY
DEFAULT_ROWS = ["awq:128x512", "gptq:128x512", "awq:16x512", "awq:32x256", "awq:64x128", "awq:128x64",
                "awq:32x128", "awq:64x128:s1", "awq:64x128:s2", "gptq:64x128"]


@dataclass(frozen=True)
class Row:
    method: str
    count: int
    length: int
    seed: int = 0
    search_tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Row":
        method, size, *extra = text.split(":")
        count, length = (int(v) for v in size.split("x"))
        opts = {e[0]: int(e[1:]) for e in extra}
        return cls(method, count, length, opts.get("s", 0), opts.get("t"))

    @property
    def windows_name(self) -> str:
        return f"windows-{self.count}x{self.length}-s{self.seed}"

    @property
    def name(self) -> str:
        return f"{self.method}:{self.count}x{self.length}:s{self.seed}" + (
            f":t{self.search_tokens}" if self.search_tokens else "")


def timed(fn):
    """-> (fn(), {"wall": s, "cpu": user + sys s}) of this process."""
    start, before = time.time(), os.times()
    out = fn()
    after = os.times()
    cpu = after.user + after.system - before.user - before.system
    return out, {"wall": round(time.time() - start, 1), "cpu": round(cpu, 1)}


def windows_for(row: Row, work: Path) -> tuple[torch.Tensor, dict]:
    """The row's sampled windows and the seconds sampling them cost (sampled once, kept in work)."""
    path = work / f"{row.windows_name}.pt"
    if not path.is_file():
        windows, seconds = timed(lambda: sample_token_windows(TINY, row.count, row.length, row.seed, device="cpu",
                                                              show_progress=False)[0])
        torch.save(windows, path)
        (work / f"{row.windows_name}.json").write_text(json.dumps(seconds | {"threads": torch.get_num_threads()}))
    return torch.load(path), json.loads((work / f"{row.windows_name}.json").read_text())


def quantize_row(row: Row, calib: torch.Tensor, out: Path) -> dict:
    awq = AWQSettings() if row.search_tokens is None else AWQSettings(search_tokens=row.search_tokens)
    cfg = QuantizeConfig(method=row.method, device="cpu", awq=awq)
    source = load_source(TINY)
    _, seconds = timed(lambda: quantize_model(source, calib, cfg, out, overwrite=True, show_progress=False))
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="METHOD:COUNTxLENGTH[:sSEED][:tTOKENS]")
    parser.add_argument("--work", default="/tmp/default-calib-cpu")
    parser.add_argument("--tokens", type=int, default=32768, help="held-out val.txt tokens to evaluate on")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=str(quant_quality.REPO / "bench" / "results" /
                                             "default-calib-cpu-tiny-qwen2.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [Row.parse(r) for r in args.rows]
    results_path = work / "rows.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}

    for row in rows:
        if row.name in results:
            continue
        calib, sample_seconds = windows_for(row, work)
        ckpt = work / row.name.replace(":", "-")
        quantize_seconds = quantize_row(row, calib, ckpt)
        results[row.name] = {"sample_seconds": sample_seconds, "quantize_seconds": quantize_seconds,
                             "threads": torch.get_num_threads(), "checkpoint": str(ckpt)}
        results_path.write_text(json.dumps(results, indent=2))
        print(f"{row.name}: sampled in {sample_seconds}, quantized in {quantize_seconds}", flush=True)

    todo = {name: Path(r["checkpoint"]) for name, r in results.items()
            if "accuracy" not in r and name in {row.name for row in rows}}
    if todo:
        cfg = load_model_config(TINY)[0]
        windows = quant_quality.val_windows(TINY, args.tokens)
        accuracy = quant_quality.run_rows(cfg, quant_quality.dense_weights(TINY), windows, todo)
        for name in todo:
            results[name]["accuracy"] = accuracy[name]
        results["fp16"] = {"accuracy": accuracy["fp16"]}
        results_path.write_text(json.dumps(results, indent=2))

    result = {
        "command": "python " + " ".join(sys.argv),
        "git_commit": quant_quality._git_commit(),
        "hardware": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other "
                    f"jobs, {torch.get_num_threads()} torch threads)",
        "torch": torch.__version__,
        "protocol": f"first {args.tokens} tokens of val.txt in windows of 512, FP32 forward of dequantized weights; "
                    "KLD(fp16 || quant) and top-1 at every position (targets.md; bench/quant_quality.py)",
        "rows_key": "METHOD:COUNTxLENGTH:sSEED[:tSEARCH_TOKENS]: COUNT windows of LENGTH tokens sampled from the "
                    "model (the start token, then LENGTH - 1 tokens at temperature 1) with --calib-seed SEED; "
                    "quantizer: CLI defaults (awq asym g128, gptq sym g128) on the CPU",
        "seconds_note": "wall and cpu (user + sys) seconds of this process; wall was measured on a shared 2-core "
                        "machine while other jobs ran, so cpu seconds are the comparable figure",
        "rows": {"fp16": results["fp16"]} | {row.name: results[row.name] for row in rows},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
