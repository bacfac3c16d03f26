"""Where a decode step spends its time (GPU machine): whole step vs model vs sampler vs host work, and the GPU
kernels of a step (torch.profiler), at batch 1 and at a large batch.

    PYTHONPATH=. python bench/profile_decode.py --batches 1,256 --out bench/results/profile-decode-h200.json
"""
import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.e2e import CONFIGS, engine_for  # noqa: E402
from quant_serve.engine.sampling_params import SamplingParams  # noqa: E402


COMPILES: list[dict] = []      # Triton compilations since the last engine finished starting


def track_compiles() -> None:
    """Record every Triton JIT compilation (kernel, seconds): after the engine's warm-up there should be none."""
    from triton.runtime.jit import JITFunction
    real = JITFunction._do_compile

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = real(self, key, signature, device, constexprs, options, attrs, warmup)
        COMPILES.append({"kernel": self.fn.__name__, "s": round(time.perf_counter() - start, 3)})
        return kernel
    JITFunction._do_compile = do_compile


def wall_timed(obj, name: str, sink: list, wrap_result: list | None = None) -> None:
    """Instance-level wrapper timing obj.name() with no device sync; with wrap_result, also times the returned
    object's resolve() (the step's wait for the GPU)."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        if wrap_result is not None:
            real_resolve = result.resolve

            def resolve():
                t0 = time.perf_counter()
                value = real_resolve()
                wrap_result.append(time.perf_counter() - t0)
                return value
            result.resolve = resolve
        return result
    setattr(obj, name, wrapper)


def timed(fn, sink: list):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        sink.append(time.perf_counter() - start)
        return result
    return wrapper


def median_ms(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] * 1e3


def kernel_table(prof, steps: int, top: int = 30) -> tuple[float, list[dict]]:
    """(GPU kernel time per step in ms, the top kernels by time per step)."""
    per_name = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += event.device_time_total
            per_name[event.name][1] += 1
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    total_us = sum(t for t, _ in per_name.values())
    return total_us / steps / 1e3, [{"kernel": name[:120], "us_per_step": t / steps, "calls_per_step": n / steps}
                                    for name, (t, n) in rows[:top]]


def exposed_kernels(prof, steps: int, top: int = 16) -> list[dict]:
    """Per kernel and grid: time per call and the time it is exposed, i.e. how far it moves the end of the GPU's
    work when it finishes (under PDL a kernel's start overlaps its predecessor, so durations add to more than the
    step). Sorted by exposed time per step."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"]
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    per = defaultdict(lambda: [0.0, 0.0, 0])
    end = events[0]["ts"] if events else 0.0
    for e in events:
        row = per[f"{e['name'][:60]} grid={e.get('args', {}).get('grid')}"]
        row[0] += e["dur"]
        row[1] += max(0.0, e["ts"] + e["dur"] - end)
        row[2] += 1
        end = max(end, e["ts"] + e["dur"])
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": k, "calls_per_step": n / steps, "us_per_call": d / n, "exposed_us_per_step": x / steps}
            for k, (d, x, n) in rows]


def profile(batch: int, ctx: int, kv: str, eager: bool, steps: int = 24, int4_head: bool = False) -> dict:
    engine = engine_for(CONFIGS["qwen2.5-7b-awq"], kv, max_num_seqs=max(batch, 1), max_model_len=4096,
                        enforce_eager=eager, int4_head=int4_head)
    runner = engine.runner
    COMPILES.clear()
    # No request may finish before the measured steps end: the early ones decode while the late ones prefill.
    max_tokens = engine.max_model_len - ctx - 1
    for i in range(batch):
        engine.add_request(f"p{i}", [100 + (i + j) % 1000 for j in range(ctx)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
    torch.cuda.synchronize()
    prefill_start, prefill_steps = time.perf_counter(), 0
    mixed, step_times = None, []
    mid = max(2, batch * ctx // engine.config.scheduler.max_num_batched_tokens // 2)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        t0 = time.perf_counter()
        if prefill_steps == mid:                          # mid-phase: decodes of early sequences + a prefill chunk
            decoding = sum(s.num_output_tokens > 0 for s in engine.scheduler.running)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            mixed = {"decoding_seqs_before": decoding}
            mixed["gpu_kernel_ms_per_step"], mixed["top_kernels"] = kernel_table(prof, 1)
        else:
            engine.step()                                 # prefills (and the first decodes of early sequences)
        step_times.append(time.perf_counter() - t0)       # host wall time of the call: no sync (async steps)
        prefill_steps += 1
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - prefill_start
    # Host-side phases of the step, timed without device syncs (they keep overlapping the GPU): resolve is where
    # the host waits for the GPU; the others are host work.
    phases = {"schedule": [], "launch": [], "emit_previous": [], "resolve_wait": [], "advance": [],
              "apply_tokens": []}
    wall_timed(engine.scheduler, "schedule", phases["schedule"])
    wall_timed(runner, "launch", phases["launch"], wrap_result=phases["resolve_wait"])
    wall_timed(engine, "_emit_pending", phases["emit_previous"])
    wall_timed(engine.scheduler, "advance", phases["advance"])
    wall_timed(engine.scheduler, "apply_tokens", phases["apply_tokens"])
    # Consecutive steps without a device sync between them: with async scheduling a sync after each step would
    # also wait for the step launched ahead and leave the GPU idle while the host schedules the next one.
    sizes = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        sizes.append(len(engine.scheduler.running))
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    host_phase_ms = {k: median_ms(v) for k, v in phases.items() if v}
    for name in ("schedule", "advance", "apply_tokens"):
        vars(engine.scheduler).pop(name)
    vars(runner).pop("launch")
    vars(engine).pop("_emit_pending")
    # The breakdown wraps the parts with device syncs, which also stops the host work overlapping the GPU: it
    # runs on separate steps, after the step time above was measured without it.
    # prepare_forward: the host half of a forward (the eager inputs, the graph packing); run_forward: the rest
    parts = {"runner.run_forward": [], "sampler.sample": [], "model.compute_logits": [], "runner.prepare_forward": []}
    runner.run_forward = timed(runner.run_forward, parts["runner.run_forward"])
    runner.sampler.sample = timed(runner.sampler.sample, parts["sampler.sample"])
    engine.model.compute_logits = timed(engine.model.compute_logits, parts["model.compute_logits"])
    runner.prepare_forward = timed(runner.prepare_forward, parts["runner.prepare_forward"])
    for _ in range(steps):
        sizes.append(len(engine.scheduler.running))
        engine.step()
    if min(sizes) != batch:
        raise RuntimeError(f"decode batch shrank to {min(sizes)} of {batch} during the measured steps")
    result = {"batch": batch, "context": ctx, "kv": kv, "cuda_graphs": not eager, "step_ms": step_ms,
              "decode_tok_s": batch / (step_ms / 1e3),
              "prefill_phase_s": prefill_s, "prefill_phase_steps": prefill_steps,
              "prefill_phase_prompt_tok_s": batch * ctx / prefill_s,
              "prefill_phase_step_ms": [round(t * 1e3, 2) for t in step_times], "mixed_step_profile": mixed,
              "compiles_after_startup": list(COMPILES), "host_phase_ms": host_phase_ms,
              **{f"{k}_ms": median_ms(v) for k, v in parts.items() if v}}
    prof_steps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            engine.step()
        torch.cuda.synchronize()
    result["gpu_kernel_ms_per_step"], result["top_kernels"] = kernel_table(prof, prof_steps)
    # exposed times from a profile of the GPU alone: recording CPU activity slows the host enough that the GPU
    # waits for it, and those waits would be charged to the input copies
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            engine.step()
        torch.cuda.synchronize()
    result["exposed_kernels"] = exposed_kernels(prof, prof_steps)
    for i in range(batch):
        engine.abort(f"p{i}")
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def profile_prefill(ctx: int, kv: str, budget: int = 2048) -> dict:
    """One full prefill step of budget // ctx prompts (budget tokens): wall time and its GPU kernels."""
    engine = engine_for(CONFIGS["qwen2.5-7b-awq"], kv, max_num_seqs=256, max_model_len=4096, enforce_eager=False)
    prompts = budget // ctx
    times = []
    gen = torch.Generator().manual_seed(0)

    def fresh_prompt() -> list[int]:                      # random tokens: no prefix-cache hit between prompts
        return torch.randint(1000, 100000, (ctx,), generator=gen).tolist()

    for rep in range(4):                                  # rep 0 warms up (autotune, allocator)
        for i in range(prompts):
            engine.add_request(f"r{rep}-{i}", fresh_prompt(),
                               SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for i in range(prompts):
            engine.abort(f"r{rep}-{i}")
    for i in range(prompts):
        engine.add_request(f"p{i}", fresh_prompt(), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    computed_before = engine.runner.num_tokens_forwarded
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    if engine.runner.num_tokens_forwarded - computed_before != prompts * ctx:
        raise RuntimeError("the profiled step did not prefill every prompt token (prefix-cache hit or budget)")
    result = {"prefill_tokens": prompts * ctx, "context": ctx, "kv": kv, "step_ms": median_ms(times[1:]),
              "prefill_tok_s": prompts * ctx / (median_ms(times[1:]) / 1e3)}
    result["gpu_kernel_ms_per_step"], result["top_kernels"] = kernel_table(prof, 1)
    for i in range(prompts):
        engine.abort(f"p{i}")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/profile-decode-h200.json")
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv", default="fp8")
    parser.add_argument("--eager", action="store_true", help="also profile without CUDA graphs")
    parser.add_argument("--prefill", action="store_true", help="also profile one 2048-token prefill step")
    parser.add_argument("--quantize-lm-head", action="store_true", help="the engine's INT4 head (--quantize-lm-head)")
    args = parser.parse_args()
    track_compiles()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"command": "PYTHONPATH=. python " + " ".join(sys.argv), "commit": commit or None,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": f"dummy Qwen2.5-7B AWQ g128{' + INT4 head' if args.quantize_lm_head else ''}, {args.kv} KV, "
                    f"{args.context}-token prompts", "runs": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        for eager in ([False, True] if args.eager else [False]):
            out["runs"].append(profile(batch, args.context, args.kv, eager, int4_head=args.quantize_lm_head))
            print(json.dumps(out["runs"][-1], indent=1), flush=True)
    if args.prefill:
        out["prefill"] = profile_prefill(args.context, args.kv)
        print(json.dumps(out["prefill"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
