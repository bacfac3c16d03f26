"""The OpenAI-compatible FastAPI app around one LLMEngine. build_app() is used by `quant-serve serve` and, in-process,
by tests."""
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.core.long_text import encode_long
from quant_serve.server.async_engine import AsyncEngine
from quant_serve.server.chat_template import ChatEncoder
from quant_serve.server.error_handlers import install_error_handlers
from quant_serve.server.http_limits import APIKeyMiddleware, BodyLimitMiddleware, default_max_request_bytes
from quant_serve.server.metrics import ServerMetrics
from quant_serve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         TokenizeRequest)
from quant_serve.server.serving import ServingContext
from quant_serve.server.serving_chat import create_chat_completion
from quant_serve.server.serving_completion import create_completion
from quant_serve.server.serving_lora import adapter_cards, install_lora_routes
from quant_serve.server.template_sandbox import TemplateSandbox

logger = logging.getLogger("quant_serve.server")

DEFAULT_MAX_QUEUED_REQUESTS = 1024


@dataclass
class ServerOptions:
    api_key: str | None = None                  # required on /v1/* and the tokenizer endpoints
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS    # waiting sequences; more: 503
    max_request_bytes: int | None = None        # None: default_max_request_bytes(max_model_len)
    body_read_timeout_s: float = 30.0
    allow_client_chat_template: bool = False
    chat_template_timeout_s: float = 5.0        # a client template's render, in its sandbox process
    tool_call_parser: str = "auto"              # the model's tool-call format; auto: from its chat template


def package_version() -> str:
    try:
        return distribution_version("quant-serve")
    except PackageNotFoundError:     # run from a checkout that was never installed
        return "unknown"


def build_app(engine: LLMEngine, served_model_names: list[str], options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    if not served_model_names:
        raise ValueError("at least one served model name is needed")
    max_request_bytes = options.max_request_bytes or default_max_request_bytes(engine.max_model_len)
    # the snapshot is read at scrape time, when async_engine exists
    metrics = ServerMetrics(served_model_names[0], snapshot=lambda: async_engine.snapshot,
                            max_model_len=engine.max_model_len)
    async_engine = AsyncEngine(engine, options.max_queued_requests, on_output=metrics.observe,
                               on_abort=metrics.forget)
    sandbox = None
    if options.allow_client_chat_template:
        sandbox = TemplateSandbox(engine.tokenizer.name_or_path, options.chat_template_timeout_s, max_request_bytes)
    ctx = ServingContext(engine, async_engine, list(served_model_names), ChatEncoder(engine.tokenizer, sandbox),
                         options.tool_call_parser)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        if sandbox is not None:
            sandbox.start()
        yield
        async_engine.shutdown()
        ctx.executor.shutdown(wait=False, cancel_futures=True)
        if sandbox is not None:
            sandbox.close()

    app = FastAPI(title="quant-serve", summary="OpenAI-compatible server", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.ctx = ctx
    install_error_handlers(app)
    # the last added runs first: the key is checked before a byte of the body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, read_timeout_s=options.body_read_timeout_s)
    if options.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key)

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
        return {"object": "list", "data": [model_card(name) for name in served_model_names] +
                adapter_cards(ctx, created)}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        adapter = [card for card in adapter_cards(ctx, created) if card["id"] == model_id]
        if model_id not in served_model_names and not adapter:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return adapter[0] if adapter else model_card(model_id)

    install_lora_routes(app, ctx)

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
        return await ctx.run(_tokenize, body)

    def _tokenize(body: TokenizeRequest) -> JSONResponse:
        """In the thread pool, the JSON of the answer included (a long prompt's ids take a while to write)."""
        tokenizer = engine.tokenizer
        if body.messages is not None:
            ids = ctx.chat.encode(body.messages, body.add_generation_prompt, body.continue_final_message,
                                  body.chat_template, body.chat_template_kwargs)
            if body.add_special_tokens:      # what the tokenizer puts around any text (a BOS), as vLLM does
                ids = tokenizer.encode("", add_special_tokens=True) + ids
        else:
            ids = encode_long(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        body.reject_unsupported()
        ctx.check_model(body.model)
        return {"prompt": await ctx.run(_detokenize, body.tokens)}

    def _detokenize(tokens: list[int]) -> str:
        vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return engine.tokenizer.decode(tokens)

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
