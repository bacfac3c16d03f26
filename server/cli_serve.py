"""`quant-serve serve [MODEL]`: the OpenAI-compatible HTTP server, with vLLM's flag names."""
import argparse
import logging
import sys

from quant_serve.server import cli
from quant_serve.server.app import DEFAULT_MAX_QUEUED_REQUESTS

logger = logging.getLogger("quant_serve")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    cli.add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts in `model`; the first one labels the metrics (default: MODEL)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="requests allowed to wait for a slot; more get 503 with Retry-After")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.set_defaults(func=cmd_serve)


def startup_report(engine) -> list[str]:
    """What was loaded, the memory it takes and the KV capacity, one log line each."""
    weights = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
    num_blocks = engine.block_manager.num_blocks
    kv_bytes = engine.runner.kv_bytes_per_block() * num_blocks
    tokens = num_blocks * engine.config.cache.block_size
    quant = engine.quant_config.describe() if engine.quant_config is not None else "unquantized"
    lines = [f"loaded {engine.model_dir} ({engine.model_config.architecture}): {quant}; "
             f"{str(engine.dtype).replace('torch.', '')} on {engine.device}",
             f"memory: weights {weights / 2**20:.1f} MiB, KV cache {kv_bytes / 2**20:.1f} MiB "
             f"({num_blocks} blocks of {engine.config.cache.block_size} tokens, "
             f"{engine.runner.kv_dtype})"]
    if str(engine.device).startswith("cuda"):
        import torch
        lines[-1] += f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
    lines.append(f"KV cache: {tokens} tokens, max concurrency {tokens / engine.max_model_len:.1f} "
                 f"at {engine.max_model_len} tokens")
    return lines


def cmd_serve(args) -> int:
    if not (args.model_tag or args.model or cli.demo_model_dir()):
        print("error: no MODEL given and the bundled demo model is not installed; run "
              "`quant-serve serve MODEL_DIR_OR_HUB_ID`", file=sys.stderr)
        return 2
    import uvicorn

    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.server.app import build_app

    config = cli.engine_config_from_args(args)
    engine = LLMEngine(config)
    for line in startup_report(engine):
        logger.info(line)
    names = args.served_model_name or [args.model_tag or args.model or "quant-serve-demo"]
    app = build_app(engine, names, api_key=args.api_key, max_queued_requests=args.max_queued_requests)
    logger.info("serving %s on http://%s:%d", ", ".join(names), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=5)
    return 0
