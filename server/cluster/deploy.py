"""Several engine replicas behind one endpoint, on Ray Serve (the optional `cluster` extra).

Two deployments: EngineReplica (cluster_replica.py), N replicas of the single-server app, one engine each; and
Ingress, one thin HTTP front that reads the request, computes its prefix key (the prompt's first KV blocks, hashed
as the prefix cache hashes them) and forwards it through a deployment handle whose request router
(cluster_router.py) sends it to the replica that holds that prefix. Started by `quant-serve serve --replicas N`
(a local Ray instance) or by `serve run docs/cluster.yaml` on a Ray cluster (app_builder)."""
import argparse
import asyncio
import json
import logging
import secrets
import time

from quant_serve.server.cli import engine_args as cli_args
from quant_serve.server.cli.serve_args import resolve_api_key, serve_parser
from quant_serve.server.cluster.prefix_routing import prefix_key

logger = logging.getLogger("quant_serve.server")

ENGINE_DEPLOYMENT = "EngineReplica"
RETRY_AFTER_S = 1
REPLICA_CHECK_S = 1.0      # how often a request waiting for its replica's first bytes checks that one is still up
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


def args_from_config(config: dict) -> argparse.Namespace:
    """The `serve` flags from a config file's args mapping ({"model": "...", "max-model-len": 4096, ...}): the
    same names and checks as on the command line."""
    parser = serve_parser()
    flags = {s for action in parser._actions for s in action.option_strings}
    argv = []
    for name, value in (config or {}).items():
        flag = "--" + str(name).replace("_", "-")
        if flag not in flags:
            raise ValueError(f"unknown serve option {name!r} in the application's args")
        if value is None:
            continue
        if value is True:
            argv.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in flags:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    try:
        return parser.parse_args(argv)
    except SystemExit:       # argparse printed why; a config file's mistake is a ValueError, not an exit
        raise ValueError(f"the application's args are not valid `quant-serve serve` flags: {' '.join(argv)}") from None


class Ingress:
    """The HTTP front (wrapped by serve.deployment in build_application)."""

    def __init__(self, engine_handle, args: argparse.Namespace):
        from quant_serve.engine.load.loader import load_tokenizer
        from quant_serve.server.chat_template import ChatEncoder
        self.engine = engine_handle
        self.args = args
        model = args.model_tag or args.model or cli_args.demo_model_dir()
        self.tokenizer = load_tokenizer(args.tokenizer or model)
        self.chat = ChatEncoder(self.tokenizer)
        self.block_size = cli_args.engine_config_from_args(args).cache.block_size
        self._replicas = (0.0, 0)          # (when read, replicas running)

    # ---- the prefix key ----------------------------------------------------------------------------------
    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the replica will build them; None where there is no prompt or the request is
        malformed (the replica answers it with the single server's error)."""
        from quant_serve.server.protocol import ChatCompletionRequest
        from quant_serve.server.structured_request import plan_tools
        try:
            data = json.loads(body)
            if path == "/v1/chat/completions":
                req = ChatCompletionRequest.model_validate(data)
                plan = plan_tools(req, None)       # the tools the template renders, ahead of the messages
                return self.chat.encode(req.messages, req.add_generation_prompt, req.continue_final_message,
                                        None, req.chat_template_kwargs, plan.template_tools if plan else None)
            prompt = data["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]        # a batch of prompts: the first one routes them all
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=data.get("add_special_tokens", True))
            return [int(t) for t in prompt]
        except Exception:
            return None

    def prefix_key(self, path: str, body: bytes) -> int | None:
        if path not in ROUTED_PATHS:
            return None
        ids = self.prompt_ids(path, body)
        return prefix_key(ids, self.block_size, self.args.routing_prefix_blocks) if ids else None

    def authorized(self, request) -> bool:
        if not self.args.api_key:
            return True
        given = request.headers.get("authorization", "").encode()
        return secrets.compare_digest(given, f"Bearer {self.args.api_key}".encode())

    # ---- replicas ----------------------------------------------------------------------------------------
    async def replicas_running(self) -> int | None:
        """From the Serve controller, read at most once a second; None while the controller cannot be read."""
        read_at, count = self._replicas
        if time.monotonic() - read_at > 1.0:
            from ray import serve
            try:
                app_name = serve.get_replica_context().app_name
                status = await asyncio.to_thread(serve.status)
            except Exception as e:
                logger.warning("the Serve controller's status cannot be read: %r", e)
                return None
            deployment = status.applications[app_name].deployments.get(ENGINE_DEPLOYMENT)
            count = deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0
            self._replicas = (time.monotonic(), count)
        return count

    # ---- HTTP --------------------------------------------------------------------------------------------
    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        from quant_serve.server.cluster.replica import HTTPRequestParts
        running = await self.replicas_running()
        if request.url.path == "/health":
            state = "ok" if running else "no replica up" if running == 0 else "cluster status unavailable"
            body = {"status": state, "replicas_running": running, "replicas_target": self.args.replicas}
            return JSONResponse(body, status_code=200 if running else 503)
        if not running:
            why = ("no engine replica is up; retry later", "no_replica") if running == 0 else \
                ("the cluster's status cannot be read; retry later", "cluster_status_unavailable")
            return _unavailable(*why)
        body = await request.body()
        # a client without the key gets the replica's 401; no tokenizing on its behalf here
        key = await asyncio.to_thread(self.prefix_key, request.url.path, body) if self.authorized(request) else None
        client = (request.client.host, request.client.port) if request.client else None
        parts = HTTPRequestParts(request.method, request.url.path, request.url.query.encode(),
                                 list(request.headers.raw), body, client)
        # the router reads the key from this keyword (cluster_router.PREFIX_KEY_KWARG)
        stream = self.engine.options(stream=True).handle.remote(parts, prefix_key=key)
        try:
            head = await self._first_chunk(stream)
        except _NoReplica:
            stream.cancel()
            logger.warning("no replica left to answer %s", request.url.path)
            return _unavailable("no engine replica is up; retry later", "no_replica")
        except Exception as e:
            stream.cancel()
            logger.warning("a replica failed before answering %s: %r", request.url.path, e)
            return _unavailable("the replica serving this request failed; retry", "replica_failed")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_relay(stream, sse), status_code=head.status, headers=headers)


    async def _first_chunk(self, stream):
        """The response head from the replica. Ray's router holds a request while no replica is up (they are being
        replaced), with no time limit: the wait checks every REPLICA_CHECK_S that one still is, and gives up with
        _NoReplica when the controller says none is (a slow answer from a live replica is waited for)."""
        head = asyncio.ensure_future(stream.__anext__())
        while True:
            done, _ = await asyncio.wait({head}, timeout=REPLICA_CHECK_S)
            if done:
                return head.result()
            if await self.replicas_running() == 0:
                head.cancel()
                raise _NoReplica


class _NoReplica(Exception):
    pass


def _unavailable(message: str, code: str):
    """503 with Retry-After, as the OpenAI error object."""
    from starlette.responses import JSONResponse

    from quant_serve.server.protocol import error_body
    return JSONResponse(error_body(message, "server_error", code=code), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


async def _relay(stream, sse: bool):
    """The replica's body chunks; if the replica dies mid-stream, an SSE stream ends with an error event and
    [DONE] (as the single server ends a stream it cannot finish), never a hang."""
    from quant_serve.server.protocol import error_body
    from quant_serve.server.serving import SSE_DONE
    try:
        async for chunk in stream:
            yield chunk
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.warning("a replica failed mid-response: %r", e)
        if sse:
            body = error_body("the replica serving this stream failed; retry the request", "server_error",
                              code="replica_failed")
            yield f"data: {json.dumps(body)}\n\n{SSE_DONE}".encode()
    finally:
        stream.cancel()      # a client that went away: the replica's app sees http.disconnect and aborts


def build_application(args: argparse.Namespace):
    """The Ray Serve application for these `serve` flags (args.replicas engine replicas)."""
    # checked here, not where they are used: there a bad value fails every request (a 500 from the ingress, a router
    # that cannot start) instead of the start
    if args.replicas < 1:
        raise ValueError(f"a Ray Serve application needs replicas >= 1, got {args.replicas}")
    if args.routing_prefix_blocks < 1:
        raise ValueError(f"--routing-prefix-blocks must be >= 1, got {args.routing_prefix_blocks}")
    if args.routing_load_factor < 1.0:
        raise ValueError(f"--routing-load-factor must be >= 1 (a bound under the mean load cannot be met), got "
                         f"{args.routing_load_factor}")
    if args.replica_max_ongoing_requests < 1:
        raise ValueError(f"--replica-max-ongoing-requests must be >= 1, got {args.replica_max_ongoing_requests}")
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from quant_serve.server.cluster.replica import EngineReplica
    from quant_serve.server.cluster.router import ROUTERS
    # the key is resolved once, here, so that every replica checks the same one whatever its environment
    api_key, _ = resolve_api_key(args)
    args = argparse.Namespace(**{**vars(args), "api_key": api_key, "api_key_file": None, "func": None})
    gpus = args.replica_gpus
    if gpus is None:
        import ray
        has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
        gpus = 1 if has_gpus and args.device != "cpu" else 0
    router_kwargs = {"load_factor": args.routing_load_factor} if args.routing == "prefix" else {}
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=args.replicas, max_ongoing_requests=args.replica_max_ongoing_requests,
        ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[args.routing],
                                                  request_router_kwargs=router_kwargs))
    ingress = serve.deployment(Ingress, name="Ingress").options(
        max_ongoing_requests=args.replicas * args.replica_max_ongoing_requests, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(args), args)


def app_builder(config: dict):
    """`serve run` entry point (docs/cluster.yaml): the application's args are the `serve` flags."""
    return build_application(args_from_config(config))


def serve_local(args: argparse.Namespace) -> int:
    """`quant-serve serve --replicas N`: a local Ray instance, the application on --host/--port, until Ctrl-C."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'quant-serve[cluster]'") from None
    import signal

    def stop(signum, frame):      # SIGTERM as Ctrl-C: the replicas and the local Ray instance go down with us
        raise KeyboardInterrupt
    # "local": a Ray instance of our own even where `ray start` left one on this machine (ray.init() would join that
    # one, and serve.shutdown below would tear down every Serve application on it)
    ray.init(address="local", include_dashboard=False)
    # after ray.init, which installs its own SIGTERM handler (kill the Ray processes, sys.exit(1)): that one skips
    # serve.shutdown and leaves the raylet's agent processes behind
    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name="quant-serve", route_prefix="/")
        logger.info("serving on http://%s:%d with %d replicas (%s routing)", args.host, args.port, args.replicas,
                    args.routing)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
