"""`quant-serve bench serve`: a streaming load client against a running OpenAI-compatible server.

Constant request rate (Poisson arrivals) or fixed concurrency, bounded by a request count and a time limit.
Reports TTFT, ITL, TPOT and end-to-end latency percentiles, throughput and goodput under an SLO."""
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from quant_serve.server.cli.bench_offline import percentile, random_prompt, summarize_latencies, synthetic_lengths


@dataclass
class StreamResult:
    ok: bool = False
    disconnected: bool = False
    status: int = 0
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    token_times: list[float] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      disconnect_after: int | None, api_key: str | None) -> StreamResult:
    result = StreamResult(prompt_len=len(prompt), start=time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.token_times.append(now)
                    if disconnect_after is not None and len(result.token_times) >= disconnect_after:
                        result.disconnected = True
                        return result          # leaving the context manager closes the connection mid-stream
        result.latency = time.perf_counter() - result.start
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(url: str, model: str, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                   request_rate: float | None, concurrency: int | None, duration_s: float, seed: int = 0,
                   range_ratio: float = 0.0, disconnect_prob: float = 0.0, api_key: str | None = None,
                   slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict:
    rng = random.Random(seed)
    in_lens = synthetic_lengths(num_prompts, input_len, range_ratio, rng)
    out_lens = synthetic_lengths(num_prompts, output_len, range_ratio, rng)
    prompts = [random_prompt(n, vocab_size, {0, 1, 2}, rng) for n in in_lens]
    limit = asyncio.Semaphore(concurrency or num_prompts)
    deadline = time.perf_counter() + duration_s
    results: list[StreamResult] = []

    async def worker(i: int, client: httpx.AsyncClient):
        async with limit:
            if time.perf_counter() > deadline:
                return
            cut = rng.randint(1, max(1, out_lens[i] - 1)) if rng.random() < disconnect_prob else None
            results.append(await one_request(client, url, model, prompts[i], out_lens[i], cut, api_key))

    timeout = httpx.Timeout(duration_s + 60, connect=10)
    limits = httpx.Limits(max_connections=(concurrency or num_prompts) + 8)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        for i in range(num_prompts):
            if time.perf_counter() > deadline:
                break
            tasks.append(asyncio.create_task(worker(i, client)))
            if request_rate:
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return summarize(results, elapsed, slo_ttft_s, slo_tpot_s)


def summarize(results: list[StreamResult], elapsed: float, slo_ttft_s, slo_tpot_s) -> dict:
    done = [r for r in results if r.ok]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [(r.latency - r.ttft) / (len(r.token_times) - 1) for r in done if len(r.token_times) > 1]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.latency for r in done]
    good = [r for r in done if (slo_ttft_s is None or (r.ttft or 0) <= slo_ttft_s) and
            (slo_tpot_s is None or len(r.token_times) < 2 or
             (r.latency - r.ttft) / (len(r.token_times) - 1) <= slo_tpot_s)]
    errors = [r for r in results if not r.ok and not r.disconnected]
    out_tokens = sum(r.output_tokens or len(r.token_times) for r in done)
    return {
        "requests_sent": len(results), "completed": len(done), "disconnected": sum(r.disconnected for r in results),
        "errors": len(errors), "server_errors_5xx": sum(r.status >= 500 for r in errors),
        "error_samples": [f"{r.status} {r.error}" for r in errors[:5]],
        "elapsed_s": elapsed, "output_tok_s": out_tokens / elapsed, "requests_per_s": len(done) / elapsed,
        "goodput_requests_per_s": len(good) / elapsed,
        **summarize_latencies("ttft", ttft), **summarize_latencies("tpot", tpot), **summarize_latencies("itl", itl),
        **summarize_latencies("e2e", e2e), "ttft_max_s": max(ttft) if ttft else None,
        "p99_e2e_s": percentile(e2e, 99),
    }
