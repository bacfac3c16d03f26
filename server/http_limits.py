"""What a client must do before the app works for it: present the API key, send its headers within a deadline, and
send a body no larger than --max-request-bytes within another. Plain ASGI middlewares (BaseHTTPMiddleware gets in
the way of streaming) and a subclass of uvicorn's h11 protocol."""
import asyncio
import logging
import secrets

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from quant_serve.server.protocol import error_body

logger = logging.getLogger("quant_serve.server")

# vLLM keeps these behind the key too; /health, /metrics, /version and the OpenAPI docs stay open
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def default_max_request_bytes(max_model_len: int) -> int:
    """Room for a prompt of max_model_len tokens written out at its most verbose (token ids or \\u-escaped text
    take up to ~64 bytes a token), at least 2 MiB."""
    return max(2 << 20, 64 * max_model_len)


async def _send_error(scope, receive, send, status: int, message: str, code: str,
                      headers: dict | None = None) -> None:
    body = error_body(message, "invalid_request_error", code=code)
    await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


class APIKeyMiddleware:
    """/v1/* and the tokenizer endpoints need 'Authorization: Bearer <key>'."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in TOKENIZER_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                await _send_error(scope, receive, send, 401,
                                  "Incorrect or missing API key: send 'Authorization: Bearer <key>'", "invalid_api_key")
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body before the app sees the request: more than max_bytes is a 413 (from Content-Length
    before anything is read), a body that takes longer than read_timeout_s a 408. The app then gets the body in
    one message, and the connection's own messages after it (its disconnect)."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                     "(--max-request-bytes)")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(scope, receive, send, 413, too_large, "request_too_large", {"Connection": "close"})
            return
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _send_error(scope, receive, send, 408,
                                  f"the request body did not arrive within {self.read_timeout_s:g} s",
                                  "request_timeout", {"Connection": "close"})
                return
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _send_error(scope, receive, send, 413, too_large, "request_too_large", {"Connection": "close"})
                return
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's head: a connection that has not sent a complete
    request line and headers within header_timeout_s of opening (or of starting its next request) is closed, so
    slow-header clients cannot pile up connections forever."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()               # the first bytes of the next request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()            # the head is complete

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection that sent no complete request head in %g s", header_timeout_s)
                self.transport.close()

    return HeaderTimeoutH11Protocol
