"""Where a grammar-constrained decode step spends its host time (GPU machine; issue 34's gap): the engine's host
phases are wrapped with timers while `quant-serve bench offline --structured-outputs json-schema
--compare-unconstrained` runs its load; per phase the count, sum and percentiles of the timed (second) round.

    PYTHONPATH=. python bench/profile_structured.py --llguidance-threads 0,4 \
        --out bench/results/profile-structured-h200.json
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
              "--kv-cache-dtype fp8 --num-prompts {num_prompts} --input-len 128 --output-len {output_len} --max-model-len {max_model_len} "
              "--structured-outputs json-schema --compare-unconstrained")
PHASES = [(llm_engine.LLMEngine, "_schedule_and_launch", "schedule + launch"),
          (llm_engine.LLMEngine, "_apply", "previous tokens (wait + apply)"),
          (llm_engine.LLMEngine, "_emit_pending", "outputs (detokenize)"),
          (model_runner.ModelRunner, "sample", "sampling (host side)"),
          (structured_mask.GrammarMasks, "fill", "mask fill (all rows)"),
          (structured_mask._SequenceGrammar, "catch_up", "matcher catch-up (one row)")]


def instrument(times: dict[str, list[float]], threads: int) -> None:
    def timed(fn, key):
        def wrap(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            times[key].append(time.perf_counter() - t)
            return r
        return wrap
    for cls, name, key in PHASES:
        setattr(cls, name, timed(getattr(cls, name), key))
    step = llm_engine.LLMEngine.step

    def timed_step(self):
        fills, t = len(times["mask fill (all rows)"]), time.perf_counter()
        out = step(self)
        kind = "constrained" if len(times["mask fill (all rows)"]) > fills else "unconstrained"
        times[f"step ({kind})"].append(time.perf_counter() - t)
        return out
    llm_engine.LLMEngine.step = timed_step
    if threads:
        import llguidance
        fill = structured_mask.GrammarMasks.fill

        def fill_with_threads(self, *a, **k):
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=threads)
            return fill(self, *a, **k)
        structured_mask.GrammarMasks.fill = fill_with_threads


def summary(times: dict[str, list[float]]) -> dict:
    out = {}
    for key, values in times.items():
        ms = np.array(values[len(values) // 2:]) * 1e3          # the second of the two rounds
        out[key] = {"n": len(ms), "sum_ms": float(ms.sum()),
                    **{f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)}, "max_ms": float(ms.max())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b-instruct")   # a config shipped with the package
    ap.add_argument("--tokenizer", default="engine/load/demo_model")
    ap.add_argument("--llguidance-threads", type=int, default=0, help="0: llguidance's default pool")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    times: dict[str, list[float]] = defaultdict(list)
    instrument(times, args.llguidance_threads)
    bench_json = "/tmp/profile-structured-bench.json"
    argv = BENCH_ARGS.format(model=args.model, tokenizer=args.tokenizer, num_prompts=args.num_prompts,
                             output_len=args.output_len, max_model_len=args.max_model_len).split() + ["--output-json", bench_json]
    if cli.main(argv):
        sys.exit("the bench failed")
    with open(bench_json) as f:
        bench = json.load(f)
    result = {"command": " ".join(sys.argv), "llguidance_threads": args.llguidance_threads or "default",
              "constrained_over_unconstrained": bench.get("constrained_over_unconstrained"),
              "phases": summary(times)}
    for key, row in result["phases"].items():
        print(f"{key:32s} n={row['n']:6d} sum={row['sum_ms']:9.1f} ms p50={row['p50_ms']:7.3f} "
              f"p90={row['p90_ms']:7.3f} p99={row['p99_ms']:7.3f} max={row['max_ms']:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
