"""The host side of a constrained decode step on CPU, without a model (issue 54): BATCH sequences follow one of the
bench's schemas (server/cli/bench_offline.BENCH_SCHEMAS), each step picking a random allowed token (as dummy weights
do), through the engine's own mask code (engine/sample/structured_mask.compute_masks: catch-up, the batch fill, the forced
chains); per step the time of that call and the share of tokens that were forced.

    python bench/structured_masks.py --out bench/results/structured-masks-cpu.json
"""
import argparse
import json
import random
import time
from pathlib import Path

import llguidance
import numpy as np
from transformers import AutoTokenizer

from quant_serve.engine.sample.structured import GrammarCompiler, StructuredOutputsParams
from quant_serve.engine.sample.structured_mask import _Row, compute_masks
from quant_serve.server.cli.bench_offline import BENCH_SCHEMAS


def run(compiler: GrammarCompiler, schema: dict, batch: int, steps: int, max_forced: int, seed: int) -> dict:
    rng = random.Random(seed)
    template = compiler._compiled(StructuredOutputsParams(json=schema))[1]
    matchers = [template.deep_copy() for _ in range(batch)]
    pending: list[list[int]] = [[] for _ in range(batch)]         # tokens to consume before the next mask
    executor, eos = llguidance.LLExecutor(), compiler.eos_token_ids
    times, sampled, forced = [], 0, 0
    for _ in range(steps):
        rows = [_Row(i, m, pending[i]) for i, m in enumerate(matchers) if not m.is_stopped()]
        if not rows:
            break
        start = time.perf_counter()
        result = compute_masks(executor, rows, batch, compiler.vocab_size, eos, max_forced, rows)
        times.append(time.perf_counter() - start)
        words = result.mask.view(np.uint32)
        for r in rows:
            chain = result.forced.get(r.index)
            if chain is not None:               # consumed by the matcher already: the sampled one and the forced
                pending[r.index] = []
                sampled, forced = sampled + 1, forced + len(chain) - 1
                continue
            allowed = np.flatnonzero(np.unpackbits(words[r.index].view(np.uint8), bitorder="little"))
            token = rng.choice([t for t in allowed.tolist() if t not in eos] or [eos[0]])
            pending[r.index] = [token]
            sampled += 1
    ms = np.array(times) * 1e3
    return {"steps": len(times), "mask_ms_p50": float(np.percentile(ms, 50)),
            "mask_ms_p90": float(np.percentile(ms, 90)), "mask_ms_mean": float(ms.mean()),
            "tokens": sampled + forced, "forced_tokens": forced, "forced_share": forced / max(1, sampled + forced)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parents[1]
    ap.add_argument("--tokenizer", default=str(here / "engine" / "load" / "demo_model"))
    ap.add_argument("--vocab-size", type=int, default=152064, help="the logits' width (Qwen2.5-7B's by default)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    compiler = GrammarCompiler(tokenizer, args.vocab_size, (tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    result = {"tokenizer": args.tokenizer, "vocab_size": args.vocab_size, "batch": args.batch, "steps": args.steps,
              "llguidance": llguidance.__version__ if hasattr(llguidance, "__version__") else "?", "schemas": {}}
    for name, schema in BENCH_SCHEMAS.items():
        for max_forced in (0, 32):
            row = run(compiler, schema, args.batch, args.steps, max_forced, seed=0)
            result["schemas"][f"{name} forced={max_forced}"] = row
            print(f"{name:10s} forced<={max_forced:2d}: mask {row['mask_ms_p50']:.2f} ms p50 "
                  f"({row['mask_ms_p90']:.2f} p90) per step of {args.batch}; forced share {row['forced_share']:.2f} "
                  f"of {row['tokens']} tokens in {row['steps']} steps")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
