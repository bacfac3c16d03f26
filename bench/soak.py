"""Soak test of `quant-serve serve`: N concurrent streaming clients for a fixed time, some of which disconnect
mid-stream and some of which send bad requests; then checks that the server never failed, that every KV block is
back in the pool once it is idle, and that GPU and host memory stayed flat.

    PYTHONPATH=. python bench/soak.py --duration 600 --concurrency 256 -- \
        qwen2.5-7b-instruct --load-format dummy --tokenizer ../shared/models/tiny-qwen2 \
        --kv-cache-dtype fp8 --gpu-memory-gb 24

Arguments after `--` go to `quant-serve serve` (the port is added). Writes a JSON report (--out) with a timeline
of samples and a `summary` whose `passed` says whether every check held. Exit status 0 when it passed.
"""
import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BAD_BODIES = [  # each must get a 4xx OpenAI error and leave the server healthy
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "temperature": -2},
    {"prompt": [[1, 2], "x"]},
    {"prompt": list(range(3, 200_003)), "max_tokens": 4},       # longer than any context
    {"messages": "not a list"},
]


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_bytes(pid: int) -> int | None:
    """GPU memory the server process holds, from nvidia-smi (None without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1]) * 2**20
    return None


class Tally:
    def __init__(self):
        self.counts = {"completed": 0, "disconnected": 0, "bad_rejected_4xx": 0, "server_errors_5xx": 0,
                       "unexpected": 0, "transport_errors": 0, "output_tokens": 0}
        self.samples: list[str] = []

    def fail(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        if len(self.samples) < 10:
            self.samples.append(f"{kind}: {text[:300]}")


async def stream_one(client, url, model, rng: random.Random, tally: Tally, vocab: int, max_prompt: int,
                     max_output: int, disconnect_share: float) -> None:
    chat = rng.random() < 0.15
    max_tokens = rng.randint(min(8, max_output), max_output)
    if chat:
        words = " ".join(rng.choice(["the", "cat", "model", "quant", "serve", "memory", "block"])
                         for _ in range(rng.randint(5, max(5, max_prompt // 5))))
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}
    else:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(min(16, max_prompt), max_prompt))]
        path, body = "/v1/completions", {"prompt": prompt}
    body |= {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
             "temperature": rng.choice([0.0, 0.7, 1.0]), "stream_options": {"include_usage": True}}
    # A disconnecting client leaves after a random time, not after N chunks: a model whose tokens decode to no
    # text (dummy weights under a small tokenizer) streams no chunk until the end, so a chunk count never fires.
    cut_after_s = rng.uniform(0.05, 5.0) if rng.random() < disconnect_share else None
    tokens = 0
    try:
        async with asyncio.timeout(cut_after_s), client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                tally.fail("server_errors_5xx" if response.status_code >= 500 else "unexpected",
                           f"{response.status_code} {text}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.fail("server_errors_5xx", json.dumps(chunk))
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except TimeoutError:
        tally.counts["disconnected"] += 1                  # the timeout closed the connection mid-stream
        return
    tally.counts["completed"] += 1
    tally.counts["output_tokens"] += tokens


async def bad_one(client, url, model, rng: random.Random, tally: Tally) -> None:
    body = dict(rng.choice(BAD_BODIES), model=model)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = await client.post(url + path, json=body)
    if 400 <= response.status_code < 500 and "error" in response.json():
        tally.counts["bad_rejected_4xx"] += 1
    else:
        tally.fail("server_errors_5xx" if response.status_code >= 500 else "unexpected",
                   f"bad request got {response.status_code} {response.text}")


async def load(url: str, model: str, concurrency: int, duration: float, vocab: int, seed: int, tally: Tally,
               max_prompt: int, max_output: int, bad_share: float, disconnect_share: float):
    deadline = time.monotonic() + duration

    async def worker(i: int, client):
        rng = random.Random(seed * 100_003 + i)
        while time.monotonic() < deadline:
            try:
                if rng.random() < bad_share:
                    await bad_one(client, url, model, rng, tally)
                else:
                    await stream_one(client, url, model, rng, tally, vocab, max_prompt, max_output,
                                     disconnect_share)
            except httpx.HTTPError as e:
                tally.fail("transport_errors", f"{type(e).__name__}: {e}")
                await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))


async def monitor(url: str, pid: int, interval: float, stop: asyncio.Event, timeline: list, start: float,
                  tally: Tally):
    """Samples health, memory and the running tally (so a run cut short still shows its error counts)."""
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            health = (await client.get(url + "/health")).json()
            timeline.append({"t_s": round(time.monotonic() - start, 1), "rss_bytes": rss_bytes(pid),
                             "gpu_bytes": gpu_bytes(pid), **{k: health.get(k) for k in (
                                 "status", "num_requests_running", "num_requests_waiting", "num_free_blocks",
                                 "num_blocks")}, **tally.counts})
            print(json.dumps(timeline[-1]), flush=True)
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def wait_idle(url: str, timeout: float) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        end = time.monotonic() + timeout
        while True:
            health = (await client.get(url + "/health")).json()
            idle = health["num_requests_running"] == 0 and health["num_requests_waiting"] == 0
            if idle or time.monotonic() > end:
                return health
            await asyncio.sleep(1.0)


def flat(values: list[int | None], tolerance: int) -> dict:
    """A leak keeps setting new highs: the second half's peak may exceed the first half's by at most `tolerance`
    (the caching allocator's warm-up growth, which levels off, passes)."""
    vals = [v for v in values if v is not None]
    if len(vals) < 4:
        return {"ok": None, "note": "too few samples"}
    first, second = max(vals[:len(vals) // 2]), max(vals[len(vals) // 2:])
    return {"ok": second - first <= tolerance, "first_half_peak_bytes": first, "second_half_peak_bytes": second,
            "growth_bytes": second - first, "tolerance_bytes": tolerance}


async def run(args, serve_args: list[str]) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-c", "import sys; from quant_serve.server.cli.main import main; sys.exit(main(sys.argv[1:]))",
           "serve", *serve_args, "--port", str(args.port), "--served-model-name", "soak",
           "--disable-uvicorn-access-log"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(args.server_log, "w")
    server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"server exited with {server.returncode} during start (log: {args.server_log})")
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)
            info = (await client.get(url + "/tokenizer_info")).json() if args.vocab is None else {}
        vocab = args.vocab or min(int(info.get("vocab_size", 32000)), 150_000)
        startup_s = time.monotonic() - t0
        tally, timeline, stop = Tally(), [], asyncio.Event()
        start = time.monotonic()
        mon = asyncio.create_task(monitor(url, server.pid, args.sample_every, stop, timeline, start, tally))
        await load(url, "soak", args.concurrency, args.duration, vocab, args.seed, tally, args.max_prompt,
                   args.max_output, args.bad_share, args.disconnect_share)
        load_s = time.monotonic() - start
        end_health = await wait_idle(url, 180)
        await asyncio.sleep(2.0)
        stop.set()
        await mon
        end_health = await wait_idle(url, 10)
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    rss, gpu = flat([s["rss_bytes"] for s in timeline], args.rss_tolerance_mb * 2**20), \
        flat([s["gpu_bytes"] for s in timeline], args.gpu_tolerance_mb * 2**20)
    c = tally.counts
    blocks_back = end_health["num_free_blocks"] == end_health["num_blocks"]
    summary = {"duration_s": round(load_s, 1), "concurrency": args.concurrency, "startup_s": round(startup_s, 1),
               **c, "server_alive_at_end": alive, "kv_blocks_free_at_end": end_health["num_free_blocks"],
               "kv_blocks_total": end_health["num_blocks"], "all_kv_blocks_back": blocks_back,
               "host_rss": rss, "gpu_memory": gpu}
    summary["passed"] = bool(alive and blocks_back and c["server_errors_5xx"] == 0 and c["unexpected"] == 0
                             and c["transport_errors"] == 0 and rss["ok"] is not False and gpu["ok"] is not False
                             and c["completed"] > 0)
    return {"summary": summary, "error_samples": tally.samples, "timeline": timeline}


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--max-prompt", type=int, default=1536, help="prompt tokens drawn in [16, this]")
    p.add_argument("--max-output", type=int, default=384, help="max_tokens drawn in [8, this]")
    p.add_argument("--bad-share", type=float, default=0.02, help="share of requests that are invalid on purpose")
    p.add_argument("--disconnect-share", type=float, default=0.25, help="share of streams the client cuts")
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this (default: the tokenizer's)")
    p.add_argument("--sample-every", type=float, default=15.0)
    p.add_argument("--rss-tolerance-mb", type=int, default=256)
    p.add_argument("--gpu-tolerance-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default="/tmp/soak-server.log")
    p.add_argument("--out", default="bench/results/soak-h200.json")
    args = p.parse_args(argv)
    result = asyncio.run(run(args, serve_args))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    result = {"command": "PYTHONPATH=. python bench/soak.py " + " ".join(sys.argv[1:]), "commit": commit.strip(),
              "hardware": _hardware(), **result}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0 if result["summary"]["passed"] else 1


def _hardware() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"1x {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return "CPU"


if __name__ == "__main__":
    sys.exit(main())
