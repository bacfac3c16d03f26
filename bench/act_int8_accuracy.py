"""Int8 activations (issue #53) on the fixture: each quantized model's perplexity, KLD and top-1 against FP16 under
the W4A16 path (fp16 activations) and int8 activations per token and per weight group, and the issue's gate (at
most +0.2% perplexity and 0.003 KLD against the W4A16 path of the same weights), all through `quant-serve eval` on
the CPU path (the torch twins: kernels/matmul/reference_int8.py, reference_w8.py).

    python bench/act_int8_accuracy.py [--work DIR] [--max-tokens 32768] [--only NAME ...]
                                      [--out bench/results/act-int8-accuracy-tiny-qwen2.json]

Models: our AWQ and GPTQ (g128, `quant-serve quantize` on text sampled from the FP16 fixture), the AutoAWQ and
llm-compressor fixtures, a Llama-architecture copy of the fixture (LlamaForCausalLM with attention_bias; its
logits checked against the Qwen2 model's with transformers) quantized with our AWQ, and GGUF Q4_0 / Q4_K_M / Q8_0
files of the fixture (tests/gguf_fixtures.py's writer). Two evals a model: FP16 reference against the model's
three activation paths, then the model's own W4A16 path as the reference of its two int8 paths (the gate).
Reports land in WORK/reports-MAX_TOKENS/ (an existing report.json is reused: rerun with a fresh --work to
measure again).
"""
import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY = SHARED / "models" / "tiny-qwen2"
VAL = SHARED / "data" / "val.txt"
GATE_PPL_PCT, GATE_KLD = 0.2, 0.003          # kernels/matmul/int8/eligibility.py
PATHS = {"w4a16": "fp16", "int8_token": "int8/token", "int8_group": "int8/group"}


def sh(cmd: list[str], ok: tuple[int, ...] = (0,)) -> None:
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd).returncode
    if code not in ok:
        raise SystemExit(f"{' '.join(cmd)}: exit {code}")


def quantize(src: Path, out: Path, method: str, calib: Path) -> str:
    cmd = ["quant-serve", "quantize", str(src), str(out), "--method", method, "--calib", str(calib),
           "--device", "cpu", "--overwrite"]
    if not (out / "config.json").is_file():
        sh(cmd)
    return " ".join(cmd)


def llama_copy(out: Path) -> dict:
    """The fixture as LlamaForCausalLM (Qwen2 is Llama with q / k / v biases): same tensors, a Llama config;
    -> the largest logit difference between the two under transformers (fp32, one window of val.txt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in TINY.iterdir():
            if f.name != "config.json":
                shutil.copy(f, out / f.name)
        cfg = json.loads((TINY / "config.json").read_text())
        for key in ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window"):
            cfg.pop(key, None)
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True, mlp_bias=False,
                   head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], pretraining_tp=1)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ids = AutoTokenizer.from_pretrained(str(TINY)).encode(VAL.read_text()[:20000])[:512]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)(x).logits for d in (TINY, out)]
    return {"architectures": [json.loads((d / "config.json").read_text())["architectures"][0] for d in (TINY, out)],
            "tokens": len(ids), "max_abs_logit_diff": float((logits[0] - logits[1]).abs().max())}


def gguf_file(work: Path, mix: str) -> Path:
    out = work / f"tiny-qwen2-{mix}.gguf"
    if not out.is_file():
        spec = importlib.util.spec_from_file_location("gguf_fixtures", REPO / "tests" / "gguf_fixtures.py")
        fixtures = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fixtures)
        fixtures.write_gguf(TINY, out, mix)
    return out


def run_eval(out: Path, args: list[str], max_tokens: int) -> dict:
    """One `quant-serve eval` (skipped where its report.json exists) -> the report's summary."""
    if not (out / "report.json").is_file():
        sh(["quant-serve", "eval", *args, "--data", str(VAL), "--max-tokens", str(max_tokens), "--tasks", "none",
            "--layer-windows", "0", "--device", "cpu", "--out", str(out)], ok=(0, 1))   # 1: the gate failed
    return json.loads((out / "report.json").read_text())


def metrics(c: dict) -> dict:
    return {"perplexity": c["perplexity"], "ppl_change_pct": c["ppl_change_pct"],
            "ppl_change_pct_stderr": c["ppl_change_pct_stderr"], "kld": c["kld"], "kld_stderr": c["kld_stderr"],
            "kld_p99": c["kld_p99"],
            "top1": c["top1"], "activations": c["activations"]["resolved"]}


def measure(name: str, model: Path, work: Path, max_tokens: int) -> dict:
    reports = work / f"reports-{max_tokens}"
    vs_fp16 = run_eval(reports / f"{name}-vs-fp16",
                       ["--reference", str(TINY), "--model", str(model), "--activation-dtype", "fp16", "int8",
                        "--act-scale", "token", "group"], max_tokens)
    vs_w4a16 = run_eval(reports / f"{name}-vs-w4a16",
                        ["--reference", str(model), "--activation-dtype", "int8", "--act-scale", "token", "group"],
                        max_tokens)
    by_path = {c["activations"]["resolved"]: c for c in vs_fp16["candidates"]}
    own = {c["activations"]["resolved"]: c for c in vs_w4a16["candidates"]}
    layers = by_path["int8/group"]["activations"]["layers"]
    row = {"format": vs_fp16["candidates"][0]["format"], "fp16_perplexity": vs_fp16["reference"]["perplexity"],
           "weight_formats": sorted({f for layer in layers for f in layer["format"].split(" + ")}),
           "num_tokens": vs_fp16["protocol"]["num_scored_tokens"],
           "vs_fp16": {key: metrics(by_path[path]) for key, path in PATHS.items()},
           "vs_w4a16": {key: metrics(own[path]) for key, path in PATHS.items() if key != "w4a16"}}
    row["gate"] = {key: m["ppl_change_pct"] <= GATE_PPL_PCT and m["kld"] <= GATE_KLD
                   for key, m in row["vs_w4a16"].items()}
    # the same with two standard errors of margin: "free" should hold beyond this sample's noise
    row["gate_2se"] = {key: m["ppl_change_pct"] + 2 * m["ppl_change_pct_stderr"] <= GATE_PPL_PCT
                       and m["kld"] + 2 * m["kld_stderr"] <= GATE_KLD for key, m in row["vs_w4a16"].items()}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/act-int8-accuracy")
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="measure these models only")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "act-int8-accuracy-tiny-qwen2.json"))
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    calib = work / "calib.jsonl"
    calib_cmd = ["quant-serve", "make-calib", str(calib), "--samples-from", str(TINY), "--samples", "128",
                 "--sample-len", "512", "--device", "cpu"]
    builds: dict[str, str] = {"calibration": " ".join(calib_cmd)}

    def calib_file() -> Path:       # sampled once, by the first model we quantize ourselves
        if not calib.is_file():
            sh(calib_cmd)
        return calib
    llama = work / "tiny-llama"
    models = {"ours-awq-g128": lambda: (work / "ours-awq-g128", quantize(TINY, work / "ours-awq-g128", "awq", calib_file())),
              "ours-gptq-g128": lambda: (work / "ours-gptq-g128",
                                         quantize(TINY, work / "ours-gptq-g128", "gptq", calib_file())),
              "autoawq-g128": lambda: (SHARED / "models" / "tiny-qwen2-awq", "AutoAWQ 0.2.9 fixture"),
              "llmcompressor-gptq-g128": lambda: (SHARED / "models" / "tiny-qwen2-w4a16-ct",
                                                  "llm-compressor 0.14 fixture"),
              "llama-ours-awq-g128": lambda: (work / "llama-awq-g128",
                                              quantize(llama, work / "llama-awq-g128", "awq", calib_file())),
              **{f"gguf-{mix.lower()}": (lambda mix=mix: (gguf_file(work, mix), f"tests/gguf_fixtures.write_gguf "
                                                                                f"{mix}"))
                 for mix in ("Q4_0", "Q4_K_M", "Q8_0")}}
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    if args.only is None or "llama-ours-awq-g128" in args.only:
        result["llama_copy"] = llama_copy(llama)
        print("llama copy:", result["llama_copy"], flush=True)
    for name, build in models.items():
        if args.only is not None and name not in args.only:
            continue
        begin = time.perf_counter()
        path, how = build()
        builds[name] = how
        row = measure(name, path, work, args.max_tokens)
        row["built_by"], row["seconds"] = how, round(time.perf_counter() - begin, 1)
        result["rows"][name] = row
        print(name, json.dumps(row["gate"]), json.dumps(row["gate_2se"]), flush=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        result.update(command="python " + " ".join(sys.argv), git_commit=commit,
                      hardware=f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
                      torch=torch.__version__,
                      protocol=f"first {args.max_tokens} tokens of val.txt in windows of 512 (quant-serve eval, "
                               "--device cpu: fp32 activations on the W4A16 path, the W4A8 / W8A8 torch twins for "
                               "int8); vs_fp16: against the FP16 fixture; vs_w4a16: against the same weights' "
                               "W4A16 path (the gate)",
                      gate={"max_ppl_change_pct": GATE_PPL_PCT, "max_kld": GATE_KLD}, calibration=builds["calibration"])
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
