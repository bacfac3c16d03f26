"""What Ray Serve costs: requests/s of `quant-serve serve --replicas 1` (Ray's proxy, our ingress with its prefix
key, the request router, one replica) against `quant-serve serve` direct, same model and flags, short prompts
(`quant-serve bench serve`: streamed completions of random token ids). Each server is its own process, started,
warmed with a few requests, measured, stopped.

    python bench/cluster_overhead.py --out bench/results/cluster-overhead-cpu.json --device cpu
    python bench/cluster_overhead.py --out bench/results/cluster-overhead-h200.json --device cuda --num-prompts 2000

On CPU each Ray replica gets one core (Ray sets its thread count from num_cpus), so the direct server is given one
thread too (--server-threads), or the comparison would measure the thread count instead of Ray.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def bench(url: str, args, num_prompts: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "quant_serve.server.cli.main", "bench", "serve", "--url", url,
                        "--num-prompts", str(num_prompts), "--concurrency", str(args.concurrency),
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--output-json", out.name], check=True, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))


def measure(name: str, serve_flags: list[str], args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.server_threads)} if args.device == "cpu" else None
    cmd = [sys.executable, "-m", "quant_serve.server.cli.main", "--log-level", "warning", "serve", "--port", str(port),
           "--device", args.device, "--disable-uvicorn-access-log", *serve_flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        bench(url, args, args.concurrency)                      # warm-up: kernels, connections, Ray's caches
        result = bench(url, args, args.num_prompts)
    finally:
        proc.send_signal(signal.SIGINT)                         # --replicas: serve.shutdown() and ray.shutdown()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    keep = ["completed", "errors", "elapsed_s", "requests_per_s", "output_tok_s", "ttft_p50_s", "ttft_p99_s",
            "e2e_p50_s", "e2e_p99_s"]
    print(f"{name}: {result['requests_per_s']:.2f} requests/s", file=sys.stderr)
    return {k: result.get(k) for k in keep}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--server-threads", type=int, default=1, help="CPU only: torch threads of the direct server")
    args = p.parse_args()
    direct = measure("direct", [], args)
    ray = measure("ray, 1 replica", ["--replicas", "1"], args)
    result = {"setup": vars(args), "direct": direct, "ray_one_replica": ray,
              "ray_over_direct_requests_per_s": ray["requests_per_s"] / direct["requests_per_s"]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
