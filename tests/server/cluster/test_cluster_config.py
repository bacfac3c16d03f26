"""The Ray Serve application's configuration (docs/cluster.yaml, server/cluster/deploy.py's args_from_config): the
`quant-serve serve` flags by name, checked as on the command line. No Ray needed."""
import asyncio
from pathlib import Path

import pytest
import yaml

from quant_serve.server.cluster.deploy import args_from_config

CONFIG = Path(__file__).resolve().parents[3] / "docs" / "cluster.yaml"


def test_the_documented_config_reads_as_serve_flags():
    config = yaml.safe_load(CONFIG.read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "quant_serve.server.cluster.deploy:app_builder"
    args = args_from_config(app["args"])
    assert (args.model, args.served_model_name, args.replicas, args.routing) == (
        "Qwen/Qwen2.5-7B-Instruct-AWQ", ["qwen2.5-7b-instruct"], 4, "prefix")
    assert (args.routing_prefix_blocks, args.routing_load_factor, args.kv_cache_dtype, args.max_model_len) == (
        4, 1.25, "fp8", 8192)
    assert args.api_key_file == "/etc/quant-serve/api-key" and args.command == "serve"


def test_flags_without_values_and_bad_options():
    args = args_from_config({"enforce-eager": True, "enable_prefix_caching": False, "async-scheduling": True,
                             "replica-gpus": None})
    assert args.enforce_eager and not args.enable_prefix_caching and args.async_scheduling
    assert args.replica_gpus is None and args.replicas == 0
    with pytest.raises(ValueError, match="unknown serve option 'replicaz'"):
        args_from_config({"replicaz": 2})
    with pytest.raises(ValueError, match="--routing random"):      # argparse's own check, as on the command line
        args_from_config({"routing": "random"})


def test_the_ingress_keys_requests_by_their_prompt_tokens_and_only_for_clients_with_the_key():
    import json

    from starlette.requests import Request

    from quant_serve.server.cluster.deploy import Ingress
    from quant_serve.server.cluster.prefix_routing import prefix_key
    from quant_serve.server.protocol import ChatCompletionRequest
    ingress = Ingress(None, args_from_config({"api-key": "k", "routing-prefix-blocks": 2}))
    system = {"role": "system", "content": "You keep the lighthouse. " * 12}

    def chat_key(user: str):
        body = {"model": "m", "messages": [system, {"role": "user", "content": user}]}
        return ingress.prefix_key("/v1/chat/completions", json.dumps(body).encode())

    messages = ChatCompletionRequest.model_validate({"model": "m", "messages": [system, {"role": "user",
                                                                                          "content": "hi"}]}).messages
    ids = ingress.chat.encode(messages)          # the prompt tokens the replica's engine gets
    assert chat_key("hi") == prefix_key(ids, 16, 2) and chat_key("hi") == chat_key("something else entirely")
    tokens = list(range(100, 140))
    completion = json.dumps({"model": "m", "prompt": tokens}).encode()
    assert ingress.prefix_key("/v1/completions", completion) == prefix_key(tokens, 16, 2)
    assert ingress.prefix_key("/v1/completions", b"{not json") is None          # the replica answers the 400
    assert ingress.prefix_key("/v1/models", completion) is None

    def request(auth: bytes | None) -> Request:
        return Request({"type": "http", "headers": [(b"authorization", auth)] if auth else []})
    assert ingress.authorized(request(b"Bearer k"))
    assert not ingress.authorized(request(b"Bearer x")) and not ingress.authorized(request(None))


@pytest.mark.parametrize("option, value", [("routing-prefix-blocks", 0), ("routing-load-factor", 0.9),
                                           ("replica-max-ongoing-requests", 0), ("replicas", 0)])
def test_bad_routing_options_are_refused_when_the_application_is_built(option, value):
    from quant_serve.server.cluster.deploy import build_application
    args = args_from_config({"replicas": 2, option: value})
    with pytest.raises(ValueError, match=f"{option.split('-')[0]}.* >= 1"):     # before any Ray import or start
        build_application(args)


def test_serve_local_starts_its_own_ray_and_shuts_serve_down_on_sigterm(monkeypatch):
    """`quant-serve serve --replicas N` on SIGTERM: serve.shutdown, then ray.shutdown, exit 0; and a Ray instance of
    its own, never one that `ray start` left on the machine. Ray's calls are recorded, not run."""
    import signal
    import sys
    import time
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[cluster]'")
    serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[cluster]'")
    from quant_serve.server.cluster import deploy as cluster
    calls = []

    def ray_init(**kwargs):          # as ray.init does: a SIGTERM handler that kills the Ray processes and exits 1
        calls.append(("ray.init", kwargs.get("address")))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    monkeypatch.setattr(ray, "init", ray_init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray.shutdown",)))
    monkeypatch.setattr(serve, "start", lambda **_: calls.append(("serve.start",)))
    monkeypatch.setattr(serve, "run", lambda app, **_: calls.append(("serve.run", app)))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append(("serve.shutdown",)))
    monkeypatch.setattr(cluster, "build_application", lambda args: "the app")
    monkeypatch.setattr(time, "sleep", lambda s: signal.raise_signal(signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cluster.serve_local(args_from_config({"replicas": 2, "port": 8123})) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [("ray.init", "local"), ("serve.start",), ("serve.run", "the app"), ("serve.shutdown",),
                     ("ray.shutdown",)]


def test_a_chat_with_tools_is_keyed_by_the_prompt_the_template_renders_with_them():
    import json

    from quant_serve.server.cluster.deploy import Ingress
    from quant_serve.server.cluster.prefix_routing import prefix_key
    from quant_serve.server.protocol import ChatCompletionRequest
    from quant_serve.server.chat_template import ChatEncoder
    ingress = Ingress(None, args_from_config({"routing-prefix-blocks": 2}))
    # the demo model's template ignores tools; most tool-calling templates (Qwen2.5, Llama 3.1) render them first
    ingress.tokenizer.chat_template = ("{% for t in tools or [] %}tool {{ t.function.name }}: "
                                       "{{ t.function.description }}\n{% endfor %}"
                                       "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    ingress.chat = ChatEncoder(ingress.tokenizer)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    body = {"model": "m", "messages": [{"role": "system", "content": "You keep the lighthouse. " * 12},
                                       {"role": "user", "content": "hi"}], "tools": tools}
    req = ChatCompletionRequest.model_validate(body)
    with_tools = ingress.chat.encode(req.messages, tools=[t.model_dump(exclude_none=True, by_alias=True)
                                                          for t in req.tools])
    assert with_tools[:32] != ingress.chat.encode(req.messages)[:32]    # the template puts the tools first
    assert ingress.prefix_key("/v1/chat/completions", json.dumps(body).encode()) == prefix_key(with_tools, 16, 2)


def test_a_replica_checks_the_key_the_application_was_built_with_not_its_own_environment(monkeypatch):
    from types import SimpleNamespace
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[cluster]'")
    from quant_serve.server.cluster import replica as cluster_replica
    monkeypatch.setattr(cluster_replica.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1")))
    # built where no key is set (build_application resolves it: None), run on a node whose environment has one
    args = args_from_config({"replicas": 1, "device": "cpu", "max-model-len": 128, "num-gpu-blocks-override": 16})
    monkeypatch.setenv("QUANT_SERVE_API_KEY", "only-on-this-node")
    assert cluster_replica.EngineReplica(args).app.state.api_key is None
    args.api_key = "k"
    assert cluster_replica.EngineReplica(args).app.state.api_key == "k"


class _Stream:
    """A deployment handle's response stream whose head never comes (Ray's router holding the request)."""
    cancelled = False

    async def __anext__(self):
        await asyncio.Event().wait()

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self):
        self.stream = _Stream()

    def options(self, stream: bool):
        return self

    @property
    def handle(self):
        return self

    def remote(self, parts, prefix_key=None):
        return self.stream


def _call(ingress, path: str, body: bytes = b""):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    scope = {"type": "http", "method": "POST" if body else "GET", "path": path, "headers": [], "query_string": b""}
    return asyncio.run(asyncio.wait_for(ingress(Request(scope, receive)), timeout=10))


def test_a_request_held_for_a_replica_that_is_gone_gets_a_503_and_an_unreadable_status_is_a_503(monkeypatch):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[cluster]'")
    import json

    import quant_serve.server.cluster.deploy as cluster
    from quant_serve.server.cluster.deploy import Ingress
    monkeypatch.setattr(cluster, "REPLICA_CHECK_S", 0.05)
    handle = _Handle()
    ingress = Ingress(handle, args_from_config({"replicas": 2}))
    counts = iter([1, 1, 1, 0])        # up when the request arrives, then the last replica dies

    async def running():
        return next(counts)
    monkeypatch.setattr(ingress, "replicas_running", running)
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    response = _call(ingress, "/v1/completions", body)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["code"] == "no_replica" and handle.stream.cancelled

    async def unreadable():
        return None
    monkeypatch.setattr(ingress, "replicas_running", unreadable)
    response = _call(ingress, "/v1/completions", body)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["code"] == "cluster_status_unavailable"
    health = _call(ingress, "/health")
    assert health.status_code == 503 and json.loads(health.body)["status"] == "cluster status unavailable"


def test_the_controller_failing_to_answer_reads_as_unknown_not_as_an_error(monkeypatch):
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install '.[cluster]'")
    from ray import serve

    from quant_serve.server.cluster.deploy import Ingress
    ingress = Ingress(_Handle(), args_from_config({"replicas": 2}))

    def broken():
        raise ConnectionError("controller gone")
    monkeypatch.setattr(serve, "get_replica_context", lambda: type("C", (), {"app_name": "a"})())
    monkeypatch.setattr(serve, "status", broken)
    assert asyncio.run(ingress.replicas_running()) is None
