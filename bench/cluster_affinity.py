"""Prefix-cache hit rate with prefix-affinity routing against round-robin when each replica's KV cache holds only
its share of the system prompts (tests/server/cluster/test_cluster.py measures the case where every cache holds them all). A local
Ray instance, the demo model on CPU; P system prompts x U users in a shuffled order, one request at a time; the hit
rate is over the prompt tokens that could hit (each system prompt's shared full blocks, in every request after its
first).

    python bench/cluster_affinity.py --out bench/results/cluster-affinity-cpu.json
"""
import argparse
import json
import random
import socket
import sys
import time
import urllib.request


def post(url: str, path: str, body: dict) -> tuple[dict, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return dict(r.headers), json.load(r)


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    vocab = ["lantern", "harbour", "copper", "meadow", "signal", "orchard", "ledger", "glacier", "violet", "anchor"]
    return f"Persona {i}: " + " ".join(rng.choice(vocab) for _ in range(words))


def messages(system: str, user: int) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"I am user {user}; what now?"}]


def shared_tokens(url: str, system: str, block_size: int = 16) -> int:
    ids = [post(url, "/tokenize", {"messages": messages(system, u)})[1]["tokens"] for u in (0, 1)]
    common = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    return common // block_size * block_size


def run(url: str, prompts: list[str], users: int, shareable: list[int]) -> dict:
    order = [(p, u) for p in range(len(prompts)) for u in range(users)]
    random.Random(0).shuffle(order)
    seen, hits, could_hit, per_replica = set(), 0, 0, {}
    start = time.monotonic()
    for p, u in order:
        headers, body = post(url, "/v1/chat/completions", {"model": "quant-serve-demo", "max_tokens": 1,
                                                           "messages": messages(prompts[p], u)})
        per_replica.setdefault(headers["x-quant-serve-replica"], set()).add(p)
        if p in seen:
            could_hit += shareable[p]
            hits += min(body["usage"]["prompt_tokens_details"]["cached_tokens"], shareable[p])
        seen.add(p)
    return {"hit_rate": hits / could_hit, "requests": len(order), "elapsed_s": time.monotonic() - start,
            "system_prompts_per_replica": sorted(len(v) for v in per_replica.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--cache-slack", type=float, default=1.25,
                   help="each replica's KV blocks: this times its share of all system prompts' blocks, plus one "
                        "request's own")
    args = p.parse_args()
    import ray
    from ray import serve

    from quant_serve.server.cluster.deploy import args_from_config, build_application
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    prompts = [system_prompt(i, args.prompt_words) for i in range(args.prompts)]
    result = {"setup": vars(args)}
    try:
        # the caches are sized from the prompts' real token counts, read from a one-replica app
        serve.run(build_application(args_from_config({"device": "cpu", "replicas": 1})), name="quant-serve",
                  route_prefix="/")
        shareable = [shared_tokens(url, sp) for sp in prompts]
        prefix_blocks = sum(shareable) // 16
        blocks = int(args.cache_slack * prefix_blocks / args.replicas) + max(shareable) // 16 + 4
        result.update(kv_blocks_per_replica=blocks, system_prompt_blocks_total=prefix_blocks)
        for routing in ("prefix", "round-robin"):
            config = {"device": "cpu", "max-model-len": 512, "replicas": args.replicas, "routing": routing,
                      "num-gpu-blocks-override": blocks}
            serve.run(build_application(args_from_config(config)), name="quant-serve", route_prefix="/")
            result[routing] = run(url, prompts, args.users, shareable)
            print(f"{routing}: hit rate {result[routing]['hit_rate']:.3f}", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
