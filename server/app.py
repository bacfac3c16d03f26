"""The OpenAI-compatible FastAPI app around one LLMEngine. build_app() is used by `quant-serve serve` and, in-process,
by tests."""
import logging
import secrets
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.server.async_engine import AsyncEngine, EngineRequestError
from quant_serve.server.metrics import ServerMetrics
from quant_serve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             TokenizeRequest, error_body)
from quant_serve.server.serving import ClientDisconnected, ServingContext
from quant_serve.server.serving_chat import create_chat_completion, render_chat
from quant_serve.server.serving_completion import create_completion

logger = logging.getLogger("quant_serve.server")

DEFAULT_MAX_QUEUED_REQUESTS = 1024


def package_version() -> str:
    try:
        return distribution_version("quant-serve")
    except PackageNotFoundError:     # run from a checkout that was never installed
        return "unknown"


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which gets in the way of streaming): /v1/* needs the bearer key;
    /health, /metrics and the tokenizer endpoints stay open, as in vLLM."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                  "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # OpenAI clients expect 400 with an error object, never FastAPI's 422 {"detail": [...]}.
        errors = e.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}",
                          "invalid_request_error")
        where = [".".join(str(x) for x in err.get("loc", ()) if x != "body") for err in errors]
        message = "; ".join(f"{w or 'body'}: {err.get('msg', 'invalid')}" for w, err in zip(where[:5], errors))
        return _error(400, message or "invalid request", "invalid_request_error", where[0] if where else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error",
                      headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, e: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(EngineRequestError)
    async def engine_error(request: Request, e: EngineRequestError):
        return _error(500, str(e), "server_error", code="internal_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("request %s %s failed", request.method, request.url.path)
        return _error(500, f"internal error: {e!r}", "server_error", code="internal_error")


def build_app(engine: LLMEngine, served_model_names: list[str], api_key: str | None = None,
              max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS) -> FastAPI:
    if not served_model_names:
        raise ValueError("at least one served model name is needed")
    # the snapshot is read at scrape time, when async_engine exists
    metrics = ServerMetrics(served_model_names[0], snapshot=lambda: async_engine.snapshot,
                            max_model_len=engine.max_model_len)
    async_engine = AsyncEngine(engine, max_queued_requests, on_output=metrics.observe, on_abort=metrics.forget)
    ctx = ServingContext(engine, async_engine, list(served_model_names))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()

    app = FastAPI(title="quant-serve", summary="OpenAI-compatible server", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.ctx = ctx
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        """200 while the engine loop runs; the body shows the queues and the KV block pool."""
        s = async_engine.snapshot
        body = {"status": "ok", "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage, "num_free_blocks": s.num_free_blocks,
                "num_blocks": s.num_blocks}
        if async_engine.started and not async_engine.is_alive:
            return JSONResponse({**body, "status": "engine loop stopped"}, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "quant-serve",
                "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len,
                "permission": []}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id not in served_model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        body.reject_unsupported()
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = render_chat(ctx, body.messages, body.add_generation_prompt, body.continue_final_message)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt
            add_special = body.add_special_tokens is not False
        ids = engine.tokenizer.encode(text, add_special_tokens=add_special)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        body.reject_unsupported()
        ctx.check_model(body.model)
        vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What vLLM returns (the tokenizer config), so that clients such as lm-eval need no local tokenizer."""
        tok = engine.tokenizer
        info = {k: v for k, v in getattr(tok, "init_kwargs", {}).items()
                if isinstance(v, (str, int, float, bool)) or v is None}
        info.update(tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
                    pad_token=tok.pad_token, unk_token=tok.unk_token, chat_template=tok.chat_template,
                    model_max_length=engine.max_model_len, vocab_size=len(tok))
        return info

    return app
