"""Where a grammar-constrained decode step spends its host time (GPU machine; issues 34 and 54): the engine's host
phases are wrapped with timers while `quant-serve bench offline --structured-outputs json-schema
--compare-unconstrained` runs its load; per phase the count, sum and percentiles of the timed (second) round, and
the timeline of a few constrained steps (each phase's start and end in ms from the step's start): with async
scheduling a step schedules and prepares the next, waits for the masks begun in a worker thread ("mask wait"),
queues the sampling behind the forward in flight, queues the next forward, then waits for the tokens.

    PYTHONPATH=. python bench/profile_structured.py --out bench/results/profile-structured-h100.json
"""
import argparse
import json
import sys
import time
from collections import defaultdict

import numpy as np

from quant_serve.engine import llm_engine
from quant_serve.engine.worker import model_runner
from quant_serve.engine.sample import structured_mask
from quant_serve.server.cli import main as cli

BENCH_ARGS = ("bench offline --model {model} --tokenizer {tokenizer} --load-format dummy --gpu-memory-gb 24 "
              "--kv-cache-dtype fp8 --num-prompts {num_prompts} --input-len 128 --output-len {output_len} "
              "--max-model-len {max_model_len} --structured-outputs json-schema --json-schema {schema} "
              "--structured-forced-tokens {forced} --compare-unconstrained")
PHASES = [(llm_engine.LLMEngine, "schedule_step", "schedule"),
          (model_runner.ModelRunner, "prepare_step", "prepare inputs"),
          (llm_engine.LLMEngine, "_emit_pending", "outputs (detokenize)"),
          (structured_mask.GrammarMasks, "wait", "mask wait"),
          (structured_mask.GrammarMasks, "fill", "mask fill (sampler side)"),
          (model_runner.ModelRunner, "sample", "sample (queue)"),
          (model_runner.ModelRunner, "run_step", "forward (queue)"),
          (llm_engine.LLMEngine, "_apply", "tokens (wait + apply)")]
TIMELINE_STEPS = 5          # constrained steps whose timeline is kept, from the middle of the timed round


def instrument(times: dict[str, list[float]], threads: int, timeline: list) -> None:
    current: list = []          # (phase, start, end) of the step running now

    def timed(fn, key):
        def wrap(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            end = time.perf_counter()
            times[key].append(end - t)
            current.append((key, t, end))
            return r
        return wrap
    for cls, name, key in PHASES:
        setattr(cls, name, timed(getattr(cls, name), key))
    # the worker thread's masks: how long they take, beside the wait the engine saw
    structured_mask.compute_masks = timed(structured_mask.compute_masks, "mask job (worker thread)")
    step = llm_engine.LLMEngine.step

    def timed_step(self):
        current.clear()
        t = time.perf_counter()
        out = step(self)
        constrained = any(key.startswith("mask") for key, _, _ in current)
        times[f"step ({'constrained' if constrained else 'unconstrained'})"].append(time.perf_counter() - t)
        if constrained:
            timeline.append([(key, round((a - t) * 1e3, 3), round((b - t) * 1e3, 3)) for key, a, b in current])
        return out
    llm_engine.LLMEngine.step = timed_step
    if threads:
        import llguidance

        def executor(self):
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=threads)
            return self._executor
        structured_mask.GrammarMasks._llg_executor = executor


def summary(times: dict[str, list[float]]) -> dict:
    out = {}
    for key, values in times.items():
        ms = np.array(values[len(values) // 2:]) * 1e3          # the second of the two rounds
        out[key] = {"n": len(ms), "sum_ms": float(ms.sum()),
                    **{f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)}, "max_ms": float(ms.max())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b-instruct", help="a bundled config's name, dummy weights")
    ap.add_argument("--schema", default="free-text", choices=["free-text", "fixed-keys"])
    ap.add_argument("--forced", type=int, default=32, help="--structured-forced-tokens (0: every token sampled)")
    ap.add_argument("--tokenizer", default="engine/load/demo_model")
    ap.add_argument("--llguidance-threads", type=int, default=0, help="0: llguidance's default pool")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = defaultdict(list)
    timeline: list = []
    instrument(times, args.llguidance_threads, timeline)
    bench_json = "/tmp/profile-structured-bench.json"
    argv = BENCH_ARGS.format(model=args.model, tokenizer=args.tokenizer, num_prompts=args.num_prompts,
                             output_len=args.output_len, max_model_len=args.max_model_len, schema=args.schema,
                             forced=args.forced).split() + ["--output-json", bench_json]
    if cli.main(argv):
        sys.exit("the bench failed")
    with open(bench_json) as f:
        bench = json.load(f)
    result = {"command": " ".join(sys.argv), "llguidance_threads": args.llguidance_threads or "default",
              "constrained_over_unconstrained": bench.get("constrained_over_unconstrained"),
              "phases": summary(times),
              "timeline_ms": timeline[len(timeline) * 3 // 4:][:TIMELINE_STEPS]}    # steady state, timed round
    for key, row in result["phases"].items():
        print(f"{key:32s} n={row['n']:6d} sum={row['sum_ms']:9.1f} ms p50={row['p50_ms']:7.3f} "
              f"p90={row['p90_ms']:7.3f} p99={row['p99_ms']:7.3f} max={row['max_ms']:7.2f}")
    for step in result["timeline_ms"]:
        print("step: " + ", ".join(f"{key} {a:.2f}-{b:.2f}" for key, a, b in step))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
