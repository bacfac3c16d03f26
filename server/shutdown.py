"""Graceful shutdown: on SIGTERM / SIGINT uvicorn stops accepting connections and closes the idle ones; the requests
in flight get shutdown_timeout seconds to finish, then each one still open ends with a 503 error (a stream: an error
event and [DONE]) before uvicorn closes its connection."""
import asyncio
import logging

import uvicorn

from quant_serve.server.async_engine import AsyncEngine
from quant_serve.server.protocol import APIError

logger = logging.getLogger("quant_serve.server")

FLUSH_S = 5.0      # after the grace period, for the error events to reach their clients before uvicorn cancels


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down; retry the request on another instance", type="server_error",
                    code="server_shutting_down")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout_s: float):
        config.timeout_graceful_shutdown = int(shutdown_timeout_s + FLUSH_S)
        super().__init__(config)
        self.async_engine, self.shutdown_timeout_s = async_engine, shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """uvicorn's signal handler (the main thread, between two bytecodes of the event loop)."""
        if not self._draining and self._loop is not None:
            self._draining = True
            self._loop.call_soon_threadsafe(self._begin_drain)
        super().handle_exit(sig, frame)

    def _begin_drain(self) -> None:
        logger.info("shutting down: %d requests in flight get %g s to finish", self.async_engine.num_open_requests,
                    self.shutdown_timeout_s)
        self._loop.call_later(self.shutdown_timeout_s, self._end_open_requests)

    def _end_open_requests(self) -> None:
        ended = self.async_engine.fail_all(shutting_down_error)
        if ended:
            logger.info("shutdown: ended %d requests still open after %g s", ended, self.shutdown_timeout_s)
