"""One engine replica of the Ray Serve application: the very app of `quant-serve serve` (build_app around one
LLMEngine), driven in-process through ASGI. The ingress forwards each HTTP request as HTTPRequestParts and gets back
a stream: first the head (status, headers), then the body chunks as the app sends them. So every route, error and
stream of the single-server app is the replica's, byte for byte."""
import asyncio
import logging
from dataclasses import dataclass, field

from ray import serve

from quant_serve.server.cli.serve_args import build_single_app

logger = logging.getLogger("quant_serve.server")

REPLICA_HEADER = "x-quant-serve-replica"      # which replica answered (its Ray Serve replica id)


@dataclass
class HTTPRequestParts:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)    # lower-case names, as ASGI has them
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


class EngineReplica:
    """The Ray Serve deployment class (wrapped by serve.deployment in cluster.py)."""

    def __init__(self, args):
        # the key was resolved once where the application was built (args.api_key, None for none): not this
        # replica's environment, which on another node may name a key the ingress does not check
        self.app = build_single_app(args, environ={})
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lifespan = None
        self._start_lock = asyncio.Lock()
        self._metrics_task: asyncio.Task | None = None

    async def _started(self) -> None:
        async with self._start_lock:
            if self._lifespan is None:
                lifespan = self.app.router.lifespan_context(self.app)
                await lifespan.__aenter__()
                self._lifespan = lifespan
                self._metrics_task = asyncio.create_task(self._export_metrics())

    async def _export_metrics(self, period_s: float = 1.0) -> None:
        from quant_serve.server.cluster.metrics import ReplicaMetrics
        try:
            exported = ReplicaMetrics(self.app.state.ctx.served_model_names[0])
            while True:
                exported.update(self.app.state.async_engine.snapshot)
                await asyncio.sleep(period_s)
        except Exception:
            logger.exception("exporting this replica's metrics failed; they stop here")

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        engine = self.app.state.async_engine
        if engine.started and not engine.is_alive:
            raise RuntimeError("the engine loop stopped")

    def stats(self) -> dict:
        """The engine snapshot (queues, KV usage, prefix-cache counters) and this replica's id."""
        s = self.app.state.async_engine.snapshot
        return {"replica": self.replica_id, **s.__dict__}

    async def handle(self, request: HTTPRequestParts, prefix_key: int | None = None):
        """Streams ResponseHead, then bytes chunks. prefix_key is read by the router only."""
        await self._started()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers, "client": request.client,
                 "server": ("quant-serve-replica", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()       # set when the caller stops reading: the app sees http.disconnect
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await messages.put(message)

        app_task = asyncio.create_task(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                    yield ResponseHead(message["status"], headers)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if app_task.done() and app_task.exception() is not None:
                raise app_task.exception()
        finally:
            gone.set()
            try:
                await asyncio.wait_for(app_task, timeout=5)
            except BaseException:      # the app's own handlers answered or logged whatever failed in it
                app_task.cancel()
