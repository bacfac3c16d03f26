"""`quant-serve bench offline`: drive LLMEngine directly with synthetic requests and report speed."""
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class RequestTiming:
    prompt_len: int
    output_len: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize_latencies(name: str, values: list[float]) -> dict:
    return {f"{name}_mean_s": statistics.fmean(values) if values else None,
            **{f"{name}_p{q}_s": percentile(values, q) for q in (50, 90, 99)}}


def synthetic_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform in [mean*(1-r), mean*(1+r)], at least 1 (range_ratio 0 = fixed length)."""
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_prompt(length: int, vocab_size: int, special_ids: set[int], rng: random.Random) -> list[int]:
    ids = []
    while len(ids) < length:
        t = rng.randrange(vocab_size)
        if t not in special_ids:
            ids.append(t)
    return ids


# `--structured-outputs json-schema`: every request follows this schema. Its array has no end, so each request is
# constrained for all of its output_len tokens (strings, numbers, keys and enums: masks of every kind of state).
BENCH_JSON_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
                       "price": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
                       "kind": {"enum": ["tool", "food", "book", "other"]}, "in_stock": {"type": "boolean"}},
        "required": ["name", "count", "price", "tags", "kind", "in_stock"]}}},
    "required": ["items"]}


# `--structured-outputs json-schema`, the second schema: records of mostly fixed keys (enums, booleans, a digit), so
# that most tokens of the output are forced by the grammar (keys, quotes, separators) and few are the model's choice.
BENCH_FIXED_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": {
        "type": "object",
        "properties": {"status": {"enum": ["active", "inactive", "pending"]}, "verified": {"type": "boolean"},
                       "priority": {"enum": ["low", "medium", "high"]}, "archived": {"type": "boolean"},
                       "region": {"enum": ["north", "south", "east", "west"]},
                       "level": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["status", "verified", "priority", "archived", "region", "level"]}}},
    "required": ["records"]}
BENCH_SCHEMAS = {"free-text": BENCH_JSON_SCHEMA, "fixed-keys": BENCH_FIXED_SCHEMA}


def compare_structured(engine, schemas: list[str], num_prompts: int, input_len: int, output_len: int,
                       range_ratio: float, seed: int) -> dict:
    """Two rounds of the load unconstrained, then constrained by each schema of BENCH_SCHEMAS named, each run on
    its own prompts (no prefix-cache hits across runs); the first round warms every path up, the second is the
    comparison. -> the last constrained run's result, with per schema its speed and constrained_over_unconstrained,
    and the first schema's ratio at the top."""
    from quant_serve.engine.sample.structured import StructuredOutputsParams
    keys = ("elapsed_s", "steps", "output_tok_s", "tpot_mean_s", "tpot_p50_s", "ttft_mean_s")
    rounds, result = [], {}
    for r in range(2):
        base = seed + r * (len(schemas) + 1)
        free = run_offline(engine, num_prompts, input_len, output_len, range_ratio, base + 1)
        row = {"unconstrained": {k: free[k] for k in keys}}
        for i, name in enumerate(schemas):
            constrained = run_offline(engine, num_prompts, input_len, output_len, range_ratio, base + 2 + i,
                                      structured_outputs=StructuredOutputsParams(json=BENCH_SCHEMAS[name]))
            row[name] = {k: constrained[k] for k in keys}
            row[name]["constrained_over_unconstrained"] = constrained["output_tok_s"] / free["output_tok_s"]
            row[name]["engine_stats_delta"] = constrained["engine_stats_delta"]
            if i == 0:
                result = constrained
        rounds.append(row)
    last = rounds[-1]
    result.update(rounds=rounds, unconstrained=last["unconstrained"], schemas={n: last[n] for n in schemas},
                  constrained_over_unconstrained=last[schemas[0]]["constrained_over_unconstrained"],
                  constrained_over_unconstrained_by_schema={
                      n: last[n]["constrained_over_unconstrained"] for n in schemas})
    return result


def run_offline(engine, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                seed: int = 0, warmup: int = 1, structured_outputs=None, lora_names: list | None = None) -> dict:
    """structured_outputs: a StructuredOutputsParams every request carries (compiled before the timed region).
    lora_names: request i runs under lora_names[i % len] (a loaded adapter's name, or None for the base)."""
    from quant_serve.engine.sampling_params import SamplingParams
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    special = set(engine.model_config.eos_token_ids) | set(getattr(engine.tokenizer, "all_special_ids", []))
    in_lens = synthetic_lengths(num_prompts, input_len, range_ratio, rng)
    out_lens = synthetic_lengths(num_prompts, output_len, range_ratio, rng)
    if warmup:  # compile kernels / capture graphs outside the timed region
        engine.generate([random_prompt(min(input_len, 32), vocab, special, rng)],
                        SamplingParams(max_tokens=min(output_len, 8), ignore_eos=True, temperature=0.0))
    if structured_outputs is not None:      # the grammar library's tokenizer and the grammar, as a server has them
        engine.grammar_compiler.compile(structured_outputs)
    stats0 = asdict(engine.stats)
    if engine.device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timings = {}
    start = time.perf_counter()
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        rid = f"bench-{i}"
        engine.add_request(rid, random_prompt(n_in, vocab, special, rng),
                           SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0,
                                          structured_outputs=structured_outputs,
                                          lora_name=lora_names[i % len(lora_names)] if lora_names else None))
        timings[rid] = RequestTiming(prompt_len=n_in, arrival=start)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outputs:
            t = timings.get(out.request_id)
            if t is None:
                continue
            new = len(out.outputs[0].delta_token_ids)
            if new and t.first_token is None:
                t.first_token = now
            t.token_times += [now] * new
            t.output_len = len(out.outputs[0].token_ids)
            if out.finished:
                t.finished = now
    elapsed = time.perf_counter() - start
    stats1 = asdict(engine.stats)
    ttft = [t.first_token - t.arrival for t in timings.values()]
    tpot = [(t.finished - t.first_token) / (t.output_len - 1) for t in timings.values() if t.output_len > 1]
    itl = [b - a for t in timings.values() for a, b in zip(t.token_times, t.token_times[1:])]
    total_out = sum(t.output_len for t in timings.values())
    result = {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio,
        "elapsed_s": elapsed, "steps": steps,
        "output_tok_s": total_out / elapsed,
        "total_tok_s": (total_out + sum(in_lens)) / elapsed,
        "requests_per_s": num_prompts / elapsed,
        **summarize_latencies("ttft", ttft), **summarize_latencies("tpot", tpot), **summarize_latencies("itl", itl),
        "preemptions": stats1["num_preemptions_total"] - stats0["num_preemptions_total"],
        "engine_stats_delta": {k: stats1[k] - stats0[k] for k in stats1 if isinstance(stats1[k], (int, float))},
    }
    if num_prompts == 1 and tpot:
        result["decode_tok_s"] = 1.0 / tpot[0]
    if engine.device != "cpu":
        result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
        result["gpu_memory_reserved_bytes"] = torch.cuda.memory_reserved()
    else:
        import resource
        result["peak_host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def measure_copy_bandwidth(nbytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), the roofline for memory-bound decode."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (begin.elapsed_time(end) / 1e3)


def decode_bytes_per_step(model) -> int:
    """Bytes every decode step must read: all weights except the embedding table (lm_head included)."""
    embed = model.model.embed_tokens.weight
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor is embed or tensor.dim() == 0:
            continue
        total += tensor.numel() * tensor.element_size()
    if model.lm_head is None:
        total += embed.numel() * embed.element_size()    # a tied head is read every step
    rope = model.model.rotary.cos_sin_cache
    return total - rope.numel() * rope.element_size()


_LATENCIES = [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
              ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")]


def format_summary(title: str, result: dict) -> str:
    """The human-readable table vLLM's benchmarks print, from a run_offline / run_load result."""
    width = 50
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value, fmt: str = "{:.2f}"):
        if value is not None:
            lines.append(f"{label + ':':<40}{fmt.format(value) if not isinstance(value, str) else value:>10}")

    row("Successful requests", result.get("completed", result.get("num_prompts")), "{:d}")
    row("Failed requests", result.get("errors"), "{:d}")
    row("Benchmark duration (s)", result.get("elapsed_s"))
    row("Request throughput (req/s)", result.get("requests_per_s"))
    row("Output token throughput (tok/s)", result.get("output_tok_s"))
    row("Total token throughput (tok/s)", result.get("total_tok_s"))
    row("Batch-1 decode (tok/s)", result.get("decode_tok_s"))
    row("Unconstrained output throughput (tok/s)", result.get("unconstrained", {}).get("output_tok_s"))
    for name, ratio in result.get("constrained_over_unconstrained_by_schema",
                                  {"": result.get("constrained_over_unconstrained")}).items():
        row(f"Constrained / unconstrained {name}".rstrip(), ratio, "{:.3f}")
    row("Spec decode acceptance rate", result.get("speculative", {}).get("acceptance_rate"), "{:.3f}")
    row("Spec decode mean accepted length", result.get("speculative", {}).get("mean_accepted_length"), "{:.3f}")
    for key, name in _LATENCIES:
        if result.get(f"{key}_mean_s") is None:
            continue
        lines.append(f" {name} ".center(width, "-"))
        for stat, label in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
            value = result.get(f"{key}_{stat}_s")
            row(f"{label} {key.upper()} (ms)", None if value is None else 1e3 * value)
    lines.append("=" * width)
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
