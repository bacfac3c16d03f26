"""The `serve` flags, the API key they name and the start-up report: shared by `quant-serve serve` (cli_serve.py)
and the Ray Serve application (cluster.py), which read the same flags."""
import logging
import os
from pathlib import Path

from quant_serve.server.cli import engine_args as cli_args
from quant_serve.server.app import DEFAULT_MAX_QUEUED_REQUESTS

API_KEY_ENV = ("QUANT_SERVE_API_KEY", "VLLM_API_KEY")

logger = logging.getLogger("quant_serve")


def serve_parser() -> cli_args.ArgumentParser:
    """The `serve` flags alone (the Ray Serve application's config file is read through them)."""
    p = cli_args.ArgumentParser(prog="quant-serve serve")
    add_serve_args(p)
    p.set_defaults(command="serve")
    return p


def add_serve_args(p) -> None:
    cli_args.add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts in `model`; the first one labels the metrics (default: MODEL)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and the tokenizer endpoints (visible in ps: "
                        f"prefer --api-key-file or {' / '.join(API_KEY_ENV)})")
    p.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from FILE")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="sequences (prompts x n) allowed to wait for a slot; more get 503 with Retry-After")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body; larger ones get 413 (default: 64 bytes a token of --max-model-len, "
                        "at least 2 MiB)")
    p.add_argument("--allow-client-chat-template", action="store_true",
                   help="accept a client's own Jinja template (chat_template, chat_template_kwargs.chat_template), "
                        "rendered in a sandbox process with a time and size limit; for trusted clients")
    p.add_argument("--chat-template-timeout", type=float, default=5.0,
                   help="seconds a client's chat template may take to render")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the model's tool-call format, parsed into tool_calls and forced by tool_choice required or "
                        "named (auto: from the chat template; hermes where it shows none)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds the requests in flight get to finish on SIGTERM before each one still open ends "
                        "with an error (streams: an error event and [DONE])")
    p.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle connection stays open")
    p.add_argument("--header-read-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a complete request head")
    p.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a request has to send its body")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    c = p.add_argument_group("several replicas (needs the cluster extra: pip install 'quant-serve[cluster]')")
    c.add_argument("--replicas", type=int, default=0,
                   help="run N engine replicas behind one endpoint on a local Ray Serve instance, requests "
                        "sharing a prompt prefix going to the same replica (0: one engine in this process)")
    c.add_argument("--routing", default="prefix", choices=["prefix", "round-robin"],
                   help="how requests are spread over the replicas: prefix affinity (consistent hashing of the "
                        "prompt's first KV blocks, with bounded load) or in turn")
    c.add_argument("--routing-prefix-blocks", type=int, default=4,
                   help="KV blocks at the start of the prompt that pick its replica")
    c.add_argument("--routing-load-factor", type=float, default=1.25,
                   help="a replica takes a prefix only while its ongoing requests stay under this factor times "
                        "the mean; past it the prefix goes to the next replica on the ring")
    c.add_argument("--replica-max-ongoing-requests", type=int, default=256,
                   help="requests Ray Serve sends to one replica at once (the engine batches them)")
    c.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 when the Ray cluster has GPUs and --device is not cpu, else 0)")


def resolve_api_key(args, environ=os.environ) -> tuple[str | None, str]:
    """The key and where it came from: --api-key, --api-key-file, then the first of API_KEY_ENV that is set. Read once
    at start-up."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif args.api_key_file is not None:
        key, source = Path(args.api_key_file).read_text().strip(), args.api_key_file
    else:
        name = next((n for n in API_KEY_ENV if environ.get(n)), None)
        if name is None:
            return None, "none"
        key, source = environ[name].strip(), name
    if not key:
        raise ValueError(f"the API key from {source} is empty")
    return key, source


def startup_report(engine) -> list[str]:
    """What was loaded, the memory it takes and the KV capacity, one log line each."""
    cache = {id(t) for t in engine.runner.block_tensors}      # an integer cache's scales are layer buffers
    weights = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers())
                  if id(t) not in cache)
    num_blocks = engine.block_manager.num_blocks
    kv_bytes = engine.runner.kv_bytes_per_block() * num_blocks
    tokens = num_blocks * engine.config.cache.block_size
    quant = engine.quant_config.describe() if engine.quant_config is not None else "unquantized"
    lines = [f"loaded {engine.model_dir} ({engine.model_config.architecture}): {quant}; "
             f"{str(engine.dtype).replace('torch.', '')} on {engine.device}",
             f"memory: weights {weights / 2**20:.1f} MiB, KV cache {kv_bytes / 2**20:.1f} MiB "
             f"({num_blocks} blocks of {engine.config.cache.block_size} tokens, "
             f"{engine.runner.kv_description})"]
    if str(engine.device).startswith("cuda"):
        import torch
        lines[-1] += f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated on the GPU"
    lines.append(f"KV cache: {tokens} tokens, max concurrency {tokens / engine.max_model_len:.1f} "
                 f"at {engine.max_model_len} tokens")
    return lines


def build_single_app(args, environ=os.environ):
    """The engine and the FastAPI app, from the parsed `serve` flags, exactly as `quant-serve serve` builds them.
    environ: where an API key not given by flag is looked up."""
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.server.app import ServerOptions, build_app

    api_key, _ = resolve_api_key(args, environ)
    engine = LLMEngine(cli_args.engine_config_from_args(args))
    for line in startup_report(engine):
        logger.info(line)
    names = args.served_model_name or [args.model_tag or args.model or "quant-serve-demo"]
    options = ServerOptions(api_key=api_key, max_queued_requests=args.max_queued_requests,
                            max_request_bytes=args.max_request_bytes, body_read_timeout_s=args.body_read_timeout,
                            allow_client_chat_template=args.allow_client_chat_template,
                            chat_template_timeout_s=args.chat_template_timeout,
                            tool_call_parser=args.tool_call_parser)
    app = build_app(engine, names, options)
    app.state.api_key = api_key
    return app
