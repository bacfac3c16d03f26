"""`quant-serve eval`: perplexity, KL divergence, top-1 agreement, task accuracy and per-layer error of quantized
candidates against an FP16 reference, a report (md, html, json) and a pass/fail gate.
Exit status: 0 the gate passed, 1 it failed, 2 error."""
import argparse
import json
import logging
import sys
import traceback

logger = logging.getLogger("quant_serve")

EPILOG = """examples:
  quant-serve eval --reference FP16_DIR --model AWQ_DIR --model GPTQ_DIR --data heldout.txt --out report/
  quant-serve eval --reference FP16_DIR --kv-cache-dtype fp8 --data heldout.txt --json
  quant-serve eval --reference AWQ_DIR --kv-cache-dtype fp8 --data heldout.txt   # FP8 KV on the INT4 weights
  quant-serve eval --reference FP16_DIR --model AWQ_DIR --activation-dtype fp16 int8 --act-scale token group \
      --data heldout.txt --device cpu      # W4A16 against int8 activations per token / per group, same weights
  quant-serve eval --reference AWQ_DIR --activation-dtype int8 --data heldout.txt --device cpu
--kv-cache-dtype adds one candidate: the reference's own weights with that KV cache, so the comparison isolates
the KV cache (pass a quantized model as --reference to measure FP8 KV on its weights).
--activation-dtype runs each --model once per activation path; without --model the reference's own weights run
its int8 paths against the reference's fp16 activations (the gate's [activations] limits; the reference always
runs fp16 activations). int8 activations run on the CPU path (torch twins of the W4A8 / W8A8 kernels).
The text in --data must be held out from calibration and training. The reference's log-probabilities of every
scored token are spilled to a temporary file (tokens x vocab x 4 bytes; --work-dir picks where)."""


def register(subparsers) -> None:
    from quant_serve.kernels.gpu import ACTIVATION_DTYPES
    from quant_serve.kernels.matmul.reference_int8 import ACT_SCALES
    p = subparsers.add_parser("eval", help="compare quantized models with a reference: perplexity, KLD, tasks",
                              description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="DIR",
                   help="candidate model directory or .gguf file; repeat for several (each is named by its "
                        "directory or file name)")
    p.add_argument("--reference", required=True, metavar="DIR", help="reference (FP16/BF16) model directory")
    p.add_argument("--data", action="append", required=True, metavar="FILE",
                   help="held-out plain text for perplexity and KLD; repeat to concatenate files")
    p.add_argument("--kv-cache-dtype", default=None, nargs="+", metavar="DTYPE",
                   choices=["fp8", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "int8", "int4"],
                   help="also evaluate the reference's weights with these KV cache dtypes (fp8 fp8_e4m3 fp8_e5m2 "
                        "fp16 bf16 int8 int4), each a candidate against the fp16 cache (fp8 int4: side by side)")
    p.add_argument("--kv-scale-source", default=None,
                   choices=["auto", "checkpoint", "file", "first-prompt", "unit"],
                   help="where fp8 K/V scales come from (default: the engine's)")
    p.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                   help="shipped task names (definitions, definitions_gen) or JSONL files; 'none' for no tasks "
                        "(default: definitions definitions_gen)")
    p.add_argument("--task-limit", type=int, default=None, metavar="N", help="use the first N items of each task")
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens of --data to score (default 32768)")
    p.add_argument("--context-len", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--stride", type=int, default=None, help="window start spacing (default: the context length)")
    p.add_argument("--layer-windows", type=int, default=4,
                   help="windows of activations for the per-layer error (0 skips it; default 4)")
    p.add_argument("--activation-dtype", nargs="+", default=["auto"], choices=ACTIVATION_DTYPES, metavar="DTYPE",
                   help="activation paths to evaluate each candidate under (auto, fp16, int8; several give one "
                        "candidate each, e.g. fp16 int8); the report names what each candidate's layers ran "
                        "(default: auto)")
    p.add_argument("--act-scale", nargs="+", default=["group"], choices=ACT_SCALES, metavar="SCALE",
                   help="int8 activation scales: token, group, or both for one candidate each (default: group)")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a PEFT LoRA adapter every model runs under, the reference too: base + adapter against FP16 "
                        "base + adapter")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="also evaluate each --model with serve's --quantize-lm-head (an INT4 g128 head at load)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    p.add_argument("--out", default=None, metavar="DIR", help="write report.md, report.html and report.json here")
    p.add_argument("--gate", default=None, metavar="TOML", help="thresholds (default: eval/default_gate.toml)")
    p.add_argument("--json", action="store_true", help="print the machine-readable summary on stdout")
    p.add_argument("--work-dir", default=None, help="directory for the reference's spilled log-probs")
    p.set_defaults(func=cmd_eval)


def config_from_args(args):
    from quant_serve.eval.harness import EvalConfig
    from quant_serve.eval.tasks import DEFAULT_TASKS
    tasks = list(DEFAULT_TASKS) if args.tasks is None else [t for t in args.tasks if t.lower() != "none"]
    return EvalConfig(reference=args.reference, models=args.model, data=args.data,
                      kv_cache_dtype=args.kv_cache_dtype, kv_scale_source=args.kv_scale_source, tasks=tasks,
                      task_limit=args.task_limit, max_tokens=args.max_tokens, context_len=args.context_len,
                      stride=args.stride or args.context_len, layer_windows=args.layer_windows, device=args.device,
                      dtype=args.dtype, work_dir=args.work_dir, quantize_lm_head=args.quantize_lm_head,
                      activation_dtypes=list(args.activation_dtype), act_scales=list(args.act_scale),
                      lora=args.lora)


def command_args(cfg, args) -> list[str]:
    """The run as an equivalent command line (also when called as a function, e.g. from tests)."""
    from quant_serve.eval.harness import kv_cache_dtypes
    out = ["--reference", cfg.reference]
    for flag, values in (("--model", cfg.models), ("--data", cfg.data)):
        for v in values:
            out += [flag, v]
    if cfg.kv_cache_dtype:
        out += ["--kv-cache-dtype", *kv_cache_dtypes(cfg)]
    out += ["--tasks", *(cfg.tasks or ["none"])]
    if cfg.task_limit:
        out += ["--task-limit", str(cfg.task_limit)]
    if cfg.quantize_lm_head:
        out += ["--quantize-lm-head"]
    if cfg.lora:
        out += ["--lora", cfg.lora]
    if cfg.activation_dtypes != ["auto"] or cfg.act_scales != ["group"]:
        out += ["--activation-dtype", *cfg.activation_dtypes, "--act-scale", *cfg.act_scales]
    out += ["--max-tokens", str(cfg.max_tokens), "--context-len", str(cfg.context_len), "--stride", str(cfg.stride),
            "--layer-windows", str(cfg.layer_windows), "--device", cfg.device, "--dtype", cfg.dtype]
    if args.gate:
        out += ["--gate", args.gate]
    return out


def cmd_eval(args) -> int:
    try:
        return _run(args)
    except Exception as e:      # exit status 2 means "no verdict", whatever went wrong
        logger.debug("eval failed", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        if args.log_level == "debug":
            traceback.print_exc()
        return 2


def _run(args) -> int:
    from quant_serve.eval.gate import check_gate, load_gate
    from quant_serve.eval.harness import run_eval
    from quant_serve.eval.metadata import run_metadata
    from quant_serve.eval.plots import check_plotting
    from quant_serve.eval.report import (check_out_dir, markdown, summary_json, write_html_report,
                                         write_text_reports)
    from quant_serve.eval.report_html import html_report

    # everything the report needs is checked before minutes of evaluation, not after
    gate = load_gate(args.gate)
    if args.out:
        check_out_dir(args.out)
        check_plotting()
    cfg = config_from_args(args)
    result = run_eval(cfg)
    metadata = run_metadata(result.device, command_args(cfg, args))
    summary = summary_json(result, metadata)
    gate_result = check_gate(gate, summary)
    summary["gate"] = gate_result.to_json()
    if args.out:
        write_text_reports(args.out, summary, gate.source)
        logger.info("wrote %s/report.json and report.md", args.out)
        abs_dp = {m.name: abs(m.stats.delta_p) for m in result.candidates}
        write_html_report(args.out, html_report(summary, abs_dp, gate.source))
        logger.info("wrote %s/report.html", args.out)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(markdown(summary, gate.source))
    for failure in gate_result.failed:
        logger.warning("gate failed: %s", failure)
    return 0 if gate_result.passed else 1
