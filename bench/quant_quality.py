"""INT4 quality on the fixture (targets.md, Accuracy): the first 32,768 tokens of val.txt in windows of 512;
perplexity, KL divergence and top-1 agreement against the FP16 model on the same windows. Every checkpoint is
dequantized to FP32 by our format readers and run through the engine decoder's non-paged forward
(engine/models/dense_calib.dense_logits).

    python bench/quant_quality.py [--calib FILE] [--work DIR] [--out bench/results/quant-quality-tiny-qwen2.json]

Quantizes the fixture with our RTN / AWQ / GPTQ through the `quant-serve quantize` CLI and measures them beside
the AutoAWQ and llm-compressor fixtures. Calibration (never val.txt): --calib, or by default 160 documents of 512
tokens sampled from the FP16 fixture itself (`quant-serve make-calib --samples-from`).
"""
import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open


REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-qwen2"
VAL = SHARED / "data" / "val.txt"
ANCHORS = {"fp16": 16.614, "rtn-asym-g128": 16.888, "autoawq-g128": 17.047, "llmcompressor-gptq-g128": 16.814}


def val_windows(model_dir: Path, num_tokens: int = 32768, window: int = 512) -> torch.Tensor:
    """-> [num_tokens / window, window] int64: the first num_tokens of val.txt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(VAL.read_text(), add_special_tokens=False)[:num_tokens]
    return torch.tensor(ids[:len(ids) // window * window]).view(-1, window)


def dense_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor as fp32, quantized linears dequantized by our readers (quant.formats)."""
    from quant_serve.quant.formats import load_quant_config
    raw = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            raw |= {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = load_quant_config(config, model_dir, set(raw))
    if qc is None:
        return {k: v.float() for k, v in raw.items()}
    out = {}
    prefixes = {k.rsplit(".", 1)[0] for k in raw if k.endswith("." + qc.marker)}
    for k, v in raw.items():
        if k.rsplit(".", 1)[0] not in prefixes:
            out[k] = v.float()
    for p in prefixes:
        tensors = {k[len(p) + 1:]: v for k, v in raw.items() if k.startswith(p + ".")}
        n, k_in = _linear_shape(tensors)
        layer = qc.make_linear(k_in, [n], "bias" in tensors, torch.float32, "cpu", [p])
        layer.load_shard(0, tensors, p)
        layer.finalize()
        out[p + ".weight"] = layer.dequantized_weight()
        if layer.bias is not None:
            out[p + ".bias"] = layer.bias.float()
    return out


def _linear_shape(t: dict) -> tuple[int, int]:
    if "weight_shape" in t:
        return tuple(int(v) for v in t["weight_shape"].tolist())
    if "g_idx" in t:                                           # GPTQ qweight [K/8, N]
        return t["qweight"].shape[1], t["qweight"].shape[0] * 8
    return t["scales"].shape[1], t["qweight"].shape[0]         # AWQ qweight [K, N/8]


@torch.no_grad()
def reference_logprobs(cfg, weights, windows: torch.Tensor, batch: int = 4) -> torch.Tensor:
    from quant_serve.engine.models.dense_calib import dense_logits
    return torch.cat([torch.log_softmax(dense_logits(cfg, weights, windows[i:i + batch]), -1)
                      for i in range(0, len(windows), batch)])                # [W, L, V]


@torch.no_grad()
def compare(cfg, weights, windows: torch.Tensor, ref: torch.Tensor, batch: int = 4) -> dict:
    """Perplexity over tokens 1..L-1 of every window; KLD(fp16 || quant) and top-1 agreement at every position."""
    from quant_serve.engine.models.dense_calib import dense_logits
    nll = kld = agree = 0.0
    for i in range(0, len(windows), batch):
        ids, r = windows[i:i + batch], ref[i:i + batch]
        lp = torch.log_softmax(dense_logits(cfg, weights, ids), -1)               # [B, L, V]
        nll -= float(lp[:, :-1].gather(-1, ids[:, 1:, None]).sum())
        kld += float((r.exp() * (r - lp)).sum())
        agree += float((r.argmax(-1) == lp.argmax(-1)).sum())
    positions = windows.numel()
    return {"perplexity": math.exp(nll / (positions - len(windows))), "kld": kld / positions,
            "top1": agree / positions}


def run_rows(cfg, fp_weights, windows, checkpoints: dict[str, Path]) -> dict[str, dict]:
    ref = reference_logprobs(cfg, fp_weights, windows)
    base = compare(cfg, fp_weights, windows, ref)["perplexity"]
    rows = {"fp16": {"perplexity": base, "change_pct": 0.0, "kld": 0.0, "top1": 1.0}}
    for name, path in checkpoints.items():
        row = compare(cfg, dense_weights(path), windows, ref)
        rows[name] = {"perplexity": row["perplexity"], "change_pct": 100 * (row["perplexity"] / base - 1),
                      "kld": row["kld"], "top1": row["top1"]}
        print(f"{name:28s} ppl {row['perplexity']:.3f} ({rows[name]['change_pct']:+.2f}%)  KLD {row['kld']:.4f}  "
              f"top-1 {100 * row['top1']:.1f}%", flush=True)
    return rows


OURS = {  # name -> quant-serve quantize flags
    "ours-rtn-asym-g128": ["--method", "rtn", "--asym"],
    "ours-rtn-sym-g128": ["--method", "rtn", "--sym"],
    "ours-awq-g128": ["--method", "awq"],
    "ours-gptq-sym-g128": ["--method", "gptq", "--sym"],
    "ours-gptq-sym-actorder-g128": ["--method", "gptq", "--sym", "--act-order"],
    "ours-gptq-asym-g128": ["--method", "gptq", "--asym"],
    "ours-gptq-asym-actorder-g128": ["--method", "gptq", "--asym", "--act-order"],
}
FIXTURES = {"autoawq-g128": SHARED / "models" / "tiny-qwen2-awq",
            "llmcompressor-gptq-g128": SHARED / "models" / "tiny-qwen2-w4a16-ct"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calib", default=None,
                        help="calibration file (default: quant-serve make-calib --samples-from)")
    parser.add_argument("--work", default="/tmp/quant-quality", help="where the quantized checkpoints go")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--only", nargs="*", default=None, help="subset of our configs to (re)run")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "quant-quality-tiny-qwen2.json"))
    args = parser.parse_args()
    from quant_serve.engine.load.loader import load_model_config
    from quant_serve.server.cli.main import main as cli
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    calib = args.calib or str(work / "calib.jsonl")
    calib_command = f"quant-serve make-calib {calib} --samples-from {TINY} --samples 160 --sample-len 512"
    if args.calib is None and cli(calib_command.split()[1:]) != 0:
        raise SystemExit(f"failed: {calib_command}")
    commands, timings = {}, {}
    for name, flags in OURS.items():
        if args.only is not None and name not in args.only:
            continue
        argv = ["quantize", str(TINY), str(work / name), *flags, "--calib", calib, "--device", "cpu", "--overwrite"]
        start = time.time()
        if cli(argv) != 0:
            raise SystemExit(f"quantize failed: {' '.join(argv)}")
        timings[name], commands[name] = round(time.time() - start, 1), "quant-serve " + " ".join(argv)
    cfg = load_model_config(TINY)[0]
    windows = val_windows(TINY, args.tokens)
    checkpoints = {n: work / n for n in OURS if (work / n / "config.json").is_file()} | FIXTURES
    rows = run_rows(cfg, dense_weights(TINY), windows, checkpoints)
    result = {
        "command": "python " + " ".join(sys.argv),
        "git_commit": _git_commit(),
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "torch": torch.__version__,
        "protocol": f"first {windows.numel()} tokens of val.txt, {len(windows)} windows of {windows.shape[1]}, "
                    "FP32 forward of dequantized weights; KLD(fp16 || quant) and top-1 at every position",
        "calibration": {"file": calib, "built_by": None if args.calib else calib_command,
                        "source": _first_row_source(calib), "windows": "128 x 512 tokens (CLI defaults)"},
        "anchors_targets_md": ANCHORS, "quantize_commands": commands, "quantize_seconds": timings,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _first_row_source(path: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        return json.loads(f.readline()).get("source")


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
        if out.returncode != 0:
            return "uncommitted"
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "uncommitted"


if __name__ == "__main__":
    sys.exit(main())
