"""`quant-serve quantize` without --calib (calibration sampled from the model itself) against a hand-picked
calibration file, for AWQ and GPTQ on the fixture, on the targets.md accuracy protocol (bench/quant_quality.py):
perplexity, KLD and top-1 against FP16 on held-out val.txt windows.

    python bench/default_calib.py [--wordnet wordnet-base_1%3a3.0-37_all.deb] [--tokens 32768] [--threads 1]
                                  [--out bench/results/default-calib-tiny-qwen2.json]

The default calibration is the CLI's own (server/cli/calib.sample_token_windows with --calib-samples 128,
--calib-seq-len 512, --calib-seed 0), sampled once and handed to both methods; the hand-picked file is the README's
demo-model recipe (`quant-serve make-calib --docstrings --wordnet ... --chat-model`), or docstrings alone without
--wordnet, tokenized as `--calib FILE` is. Quantizer settings are the CLI defaults (awq asym, gptq sym, g128).
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from quant_serve.engine.load.loader import load_model_config  # noqa: E402
from quant_serve.quant.quantize import QuantizeConfig, quantize_model  # noqa: E402
from quant_serve.server.cli.main import main as cli  # noqa: E402
from quant_serve.server.cli.calib import sample_token_windows  # noqa: E402
from quant_serve.server.cli.quantize import load_source, tokenize_calib  # noqa: E402


_HERE = Path(__file__).resolve().parent


def _bench_module(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quant_quality = _bench_module("quant_quality")
TINY = quant_quality.TINY


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wordnet", default=None, help="wordnet-base .deb for the hand-picked file (README recipe)")
    parser.add_argument("--work", default="/tmp/default-calib")
    parser.add_argument("--tokens", type=int, default=32768, help="held-out val.txt tokens to evaluate on")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=str(quant_quality.REPO / "bench" / "results" /
                                             "default-calib-tiny-qwen2.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    seconds = {}

    start = time.time()
    default, _ = sample_token_windows(TINY, 128, 512, seed=0, device="cpu")
    seconds["sample default calibration"] = round(time.time() - start, 1)
    hand_file = work / "calib.jsonl"
    make_calib = ["make-calib", str(hand_file), "--docstrings"]
    if args.wordnet:
        make_calib += ["--wordnet", args.wordnet, "--wordnet-entries", "8000", "--chat-model", str(TINY),
                       "--chat-share", "0.3"]
    if cli(make_calib) != 0:
        raise SystemExit("make-calib failed")
    hand = tokenize_calib(TINY, str(hand_file), 128, 512)
    calibs = {"default (sampled from the model)": default, "hand-picked file": hand}

    source = load_source(TINY)
    checkpoints = {}
    for calib_name, calib in calibs.items():
        for method in ("awq", "gptq"):
            name = f"{method}-g128, {calib_name}"
            out = work / f"{method}-{'default' if calib is default else 'file'}"
            start = time.time()
            quantize_model(source, calib, QuantizeConfig(method=method, device="cpu"), out, overwrite=True)
            seconds[f"quantize {name}"] = round(time.time() - start, 1)
            checkpoints[name] = out
    start = time.time()
    windows = quant_quality.val_windows(TINY, args.tokens)
    cfg = load_model_config(TINY)[0]
    rows = quant_quality.run_rows(cfg, quant_quality.dense_weights(TINY), windows, checkpoints)
    seconds["evaluate"] = round(time.time() - start, 1)
    result = {
        "command": "python " + " ".join(sys.argv),
        "git_commit": quant_quality._git_commit(),
        "hardware": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)",
        "torch": torch.__version__,
        "protocol": f"first {windows.numel()} tokens of val.txt, {len(windows)} windows of {windows.shape[1]}, "
                    "FP32 forward of dequantized weights; KLD(fp16 || quant) and top-1 at every position "
                    "(targets.md; bench/quant_quality.py)",
        "calibration": {
            "default (sampled from the model)": "128 sequences x 512 tokens: the start token, then 511 tokens "
                                                "sampled at temperature 1 (seed 0), as `quant-serve quantize` "
                                                "without --calib",
            "hand-picked file": {"built_by": "quant-serve " + " ".join(make_calib),
                                 "source": quant_quality._first_row_source(str(hand_file)),
                                 "windows": f"{hand.shape[0]} x {hand.shape[1]} tokens (CLI defaults)"}},
        "quantizer": "CLI defaults: awq asym g128 (awq format), gptq sym g128 (gptq format), on the CPU",
        "seconds": seconds,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
