"""Replicas on Ray Serve (server/cluster/deploy.py) on CPU: a local Ray instance, two replicas of the bundled demo model.
Needs the cluster extra (pip install '.[cluster]'); CI runs it in its own stage (.ci/run)."""
import json
import random
import socket
import time
import urllib.error
import urllib.request

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: the cluster tests need pip install '.[cluster]'")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[cluster]'")

from quant_serve.server.cluster.deploy import args_from_config, build_application  # noqa: E402

pytestmark = pytest.mark.slow

REPLICAS = 2
ENGINE_ACTOR = "EngineReplica"       # in the replica actors' names
USERS = 8
SYSTEM_PROMPTS = [f"You are {who}. " + " ".join([f"Rule {i}: {rule}." for i in range(6)])
                  for who, rule in [("a lighthouse keeper", "answer in one short sentence"),
                                    ("a ship's cook", "mention one spice in every reply"),
                                    ("a train conductor", "always state the next station"),
                                    ("a museum guard", "never raise your voice")]]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


METRICS_PORT = _free_port()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=REPLICAS + 1, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


_deployed: list[str] = []


def deploy(routing: str, fresh: bool = True) -> None:
    """A fresh application (fresh replicas, empty prefix caches) with this routing; fresh=False keeps one that
    already routes this way."""
    if not fresh and _deployed[-1:] == [routing]:
        return
    _deployed.append(routing)
    args = args_from_config({"device": "cpu", "max-model-len": 512, "num-gpu-blocks-override": 256,
                             "replicas": REPLICAS, "routing": routing})
    serve.run(build_application(args), name="quant-serve", route_prefix="/")


def post(url: str, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def chat(system: str, user: int, max_tokens: int = 1) -> dict:
    return {"model": "quant-serve-demo", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"I am user {user}; what should I do today?"}]}


def shared_full_blocks(url: str, system: str) -> int:
    """Prompt tokens two users of this system prompt share, in whole KV blocks of 16: what a cache hit can cover."""
    ids = [post(url, "/tokenize", {k: v for k, v in chat(system, u).items() if k == "messages"})[2]["tokens"]
           for u in (0, 1)]
    common = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    return common // 16 * 16


def run_load(url: str) -> tuple[float, dict[int, set[str]], dict[str, int]]:
    """4 system prompts x USERS users in a shuffled order; the prefix-cache hit rate over the tokens that could hit
    (every request after its system prompt's first), the replicas each system prompt went to and the cached tokens
    each replica reported."""
    order = [(p, u) for p in range(len(SYSTEM_PROMPTS)) for u in range(USERS)]
    random.Random(0).shuffle(order)
    shareable = [shared_full_blocks(url, s) for s in SYSTEM_PROMPTS]
    assert all(n >= 4 * 16 for n in shareable), shareable       # each prompt's routing blocks are all shared
    seen, hits, could_hit, replicas, cached = set(), 0, 0, {}, {}
    for p, u in order:
        status, headers, body = post(url, "/v1/chat/completions", chat(SYSTEM_PROMPTS[p], u))
        assert status == 200, body
        replica = headers["x-quant-serve-replica"]
        replicas.setdefault(p, set()).add(replica)
        cached[replica] = cached.get(replica, 0) + body["usage"]["prompt_tokens_details"]["cached_tokens"]
        if p in seen:
            could_hit += shareable[p]
            hits += min(body["usage"]["prompt_tokens_details"]["cached_tokens"], shareable[p])
        seen.add(p)
    return hits / could_hit, replicas, cached


def exported_prefix_hits(timeout_s: float = 40.0, expected: dict[str, int] | None = None) -> dict[str, int]:
    """ray_quant_serve_prefix_cache_hits_total by replica, from Ray's metrics export (it lags by seconds: polled
    until it shows `expected`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
        found = {}
        for line in text.splitlines():
            if line.startswith("ray_quant_serve_prefix_cache_hits_total{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].split(","))
                replica = labels["replica"].strip('"')
                found[replica] = found.get(replica, 0) + int(float(line.rsplit(" ", 1)[1]))
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(1)


def test_prefix_affinity_keeps_each_system_prompt_on_one_replica_and_hits_its_cache(cluster):
    start = time.monotonic()
    deploy("prefix")
    with urllib.request.urlopen(cluster + "/health") as r:
        assert json.load(r) == {"status": "ok", "replicas_running": REPLICAS, "replicas_target": REPLICAS}
    affinity, affinity_replicas, cached = run_load(cluster)
    # each replica's prefix-cache hits, labelled by replica in Ray's metrics export: what the responses said
    assert exported_prefix_hits(expected={r: n for r, n in cached.items() if n}) == {r: n for r, n in cached.items()
                                                                                      if n}
    # the single server's errors, through the ingress and a replica
    status, _, body = post(cluster, "/v1/chat/completions", {"model": "quant-serve-demo", "messages": []})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = post(cluster, "/v1/chat/completions", {**chat("x", 0), "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"

    # a hot prefix: 16 requests of one system prompt at once; past 1.25 x the mean load its owner passes
    # requests on to the next replica on the ring instead of queueing them all
    from concurrent.futures import ThreadPoolExecutor
    hot = chat(SYSTEM_PROMPTS[0], 0, max_tokens=16)
    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(lambda _: post(cluster, "/v1/chat/completions", hot)[1]["x-quant-serve-replica"],
                               range(16)))
    counts = sorted(served.count(r) for r in set(served))
    print(f"\nhot prefix, 16 concurrent requests: {counts} per replica", end="")
    # (which replica takes the most depends on when Ray Serve's load reports arrive: not checked)
    assert len(counts) == REPLICAS

    deploy("round-robin")
    round_robin, rr_replicas, _ = run_load(cluster)
    print(f"\nprefix-cache hit rate over the tokens that could hit, {len(SYSTEM_PROMPTS)} system prompts x {USERS} "
          f"users, {REPLICAS} replicas: affinity {affinity:.3f}, round-robin {round_robin:.3f} "
          f"({time.monotonic() - start:.0f} s)")
    assert all(len(r) == 1 for r in affinity_replicas.values()), affinity_replicas
    assert affinity >= 0.9
    assert all(len(r) == REPLICAS for r in rr_replicas.values()), rr_replicas
    # round-robin computes each system prompt once on every replica: at best (USERS - REPLICAS) / (USERS - 1)
    assert round_robin <= (USERS - REPLICAS) / (USERS - 1) + 1e-9
    assert affinity > round_robin


def open_stream(url: str, user: int, started, events: list) -> None:
    """One streamed chat; events gets (time, kind) for each event: 'chunk', 'error', 'done'."""
    body = {**chat(SYSTEM_PROMPTS[user % len(SYSTEM_PROMPTS)], user, max_tokens=48), "stream": True}
    body["ignore_eos"] = True
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events.append((time.monotonic(), "replica", r.headers["x-quant-serve-replica"]))
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                events.append((time.monotonic(), "done", None))
                break
            payload = json.loads(line[6:])
            events.append((time.monotonic(), "error" if "error" in payload else "chunk", payload))
            started.set()


def test_a_replica_killed_mid_stream_ends_its_streams_with_an_error_event_and_is_replaced(cluster):
    import threading
    deploy("round-robin", fresh=False)
    streams = 16
    runs = [([], threading.Event()) for _ in range(streams)]
    threads = [threading.Thread(target=open_stream, args=(cluster, u, started, events))
               for u, (events, started) in enumerate(runs)]
    for t in threads:
        t.start()
    assert all(started.wait(120) for _, started in runs)       # every stream has sent a token
    victim = next(e[2] for e in runs[0][0] if e[1] == "replica")
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if ENGINE_ACTOR in a["name"] and a["name"].endswith(victim)]
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    ended = []          # seconds from the kill to each of the victim's streams' [DONE]
    on_victim = [events for events, _ in runs if events[0][2] == victim]
    assert len(on_victim) == streams // REPLICAS
    for events, _ in runs:
        assert events[-1][1] == "done", events[-3:]             # every stream ends with [DONE]
        if events[0][2] == victim:                               # ... the killed replica's with an error event
            kind, payload = events[-2][1], events[-2][2]
            assert kind == "error" and payload["error"]["code"] == "replica_failed", events[-3:]
            assert events[-1][0] - killed_at < 5.0
            ended.append(events[-1][0] - killed_at)
        else:
            assert events[-2][1] == "chunk" and events[-2][2]["choices"][0]["finish_reason"] == "length"
    print(f"\nkilled replica {victim}: its {len(ended)} streams ended with an error event within {max(ended):.2f} s")
    # Ray Serve starts a new replica: /health shows both again, and both serve
    deadline = time.monotonic() + 90
    while True:
        with urllib.request.urlopen(cluster + "/health") as r:
            running = json.load(r)["replicas_running"]
        served = {post(cluster, "/v1/chat/completions", chat(SYSTEM_PROMPTS[0], u))[1]["x-quant-serve-replica"]
                  for u in range(4)}
        if running == REPLICAS and len(served) == REPLICAS and victim not in served:
            break
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {running} running, {served}"
        time.sleep(1)


def test_a_client_that_goes_away_frees_its_sequence_on_the_replica(cluster):
    import http.client
    deploy("round-robin", fresh=False)
    handle = serve.get_deployment_handle("EngineReplica", "quant-serve")

    def running() -> dict[str, int]:       # round-robin: consecutive calls visit every replica
        stats = [handle.stats.remote().result() for _ in range(2 * REPLICAS)]
        return {s["replica"]: s["num_running"] for s in stats}

    host, port = cluster.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "quant-serve-demo", "prompt": "hello there", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):                       # a few events: the sequence runs on its replica
        assert response.readline()
    assert sum(running().values()) == 1
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 10        # the 400 tokens would take far longer
    while sum(running().values()) != 0:
        assert time.monotonic() < deadline, "the replica kept generating for a client that went away"
        time.sleep(0.2)
