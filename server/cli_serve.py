"""`quant-serve serve [MODEL]`: the OpenAI-compatible HTTP server, with vLLM's flag names."""
import errno
import logging
import socket
import sys

from quant_serve.server import cli_args
from quant_serve.server.serve_args import API_KEY_ENV, add_serve_args, resolve_api_key, startup_report  # noqa: F401

logger = logging.getLogger("quant_serve")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    if not (args.model_tag or args.model or cli_args.demo_model_dir()):
        print("error: no MODEL given and the bundled demo model is not installed; run "
              "`quant-serve serve MODEL_DIR_OR_HUB_ID`", file=sys.stderr)
        return 2
    if args.replicas < 0:
        raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
    check_port_free(args.host, args.port)       # before the model loads (and Ray starts) rather than after
    if args.replicas > 0:
        from quant_serve.server.cluster import serve_local
        return serve_local(args)
    import uvicorn

    from quant_serve.server.http_limits import h11_protocol
    from quant_serve.server.serve_args import build_single_app
    from quant_serve.server.shutdown import GracefulServer

    _, key_source = resolve_api_key(args)
    app = build_single_app(args)
    names, api_key = app.state.ctx.served_model_names, app.state.api_key
    logger.info("serving %s on http://%s:%d (API key: %s)", ", ".join(names), args.host, args.port,
                f"from {key_source}" if api_key else "none")
    server = GracefulServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                       access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=args.timeout_keep_alive,
                       http=h11_protocol(args.header_read_timeout)),
        app.state.async_engine, args.shutdown_timeout)
    server.run()
    return 0


def check_port_free(host: str, port: int) -> None:
    """Bind every address host:port names, as uvicorn (and Ray Serve's proxy) will, and let go again: ValueError
    naming the address when one is taken or cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (--host)") from e
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn: a port in TIME_WAIT is free
            try:
                sock.bind(address)
            except OSError as e:
                hint = " (another server listens there? pick another --port)" if e.errno == errno.EADDRINUSE else ""
                raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from e
