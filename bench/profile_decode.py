"""Where a batch-1 decode step spends its time (GPU machine): whole step vs model vs sampler vs host work.

    PYTHONPATH=. python bench/profile_decode.py --out bench/results/profile-decode-h200.json
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.e2e import CONFIGS, engine_for  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        sink.append(time.perf_counter() - start)
        return result
    return wrapper


def profile(eager: bool) -> dict:
    engine = engine_for(CONFIGS["qwen2.5-7b-awq"], "auto", max_num_seqs=256, max_model_len=4096, enforce_eager=eager)
    runner = engine.runner
    parts = {"runner.forward": [], "sampler": [], "model.compute_logits": [], "runner._prepare": []}
    runner.forward = timed(runner.forward, parts["runner.forward"])
    sampler = runner.sampler
    runner.sampler = timed(sampler, parts["sampler"])
    runner.sampler.release = sampler.release
    engine.model.compute_logits = timed(engine.model.compute_logits, parts["model.compute_logits"])
    runner._prepare = timed(runner._prepare, parts["runner._prepare"])
    engine.add_request("p", list(range(100, 228)), SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    engine.step()                                     # prefill
    for v in parts.values():
        v.clear()
    steps = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    result = {"step_ms": median(steps), **{f"{k}_ms": median(v) for k, v in parts.items() if v}}
    # the model alone: replay / eager forward of one decode token without the engine around it
    del engine, runner, sampler
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/profile-decode-h200.json")
    args = parser.parse_args()
    out = {"graphs": profile(False)}
    print(json.dumps(out, indent=2), flush=True)
    out["eager"] = profile(True)
    print(json.dumps(out, indent=2))
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
