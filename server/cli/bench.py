"""`quant-serve bench {offline,serve}`: latency and throughput, as JSON on stdout and a table on stderr."""
import asyncio
import json
import platform
import subprocess
import sys
import time


def register(sub) -> None:
    from quant_serve.server.cli.engine_args import add_engine_args
    p = sub.add_parser("bench", help="measure latency and throughput")
    modes = p.add_subparsers(dest="mode", required=True)
    off = modes.add_parser("offline", help="drive the engine in-process with synthetic requests")
    add_engine_args(off)
    _add_load_args(off)
    off.add_argument("--measure-bandwidth", action="store_true", help="also measure GPU copy bandwidth (roofline)")
    off.add_argument("--structured-outputs", choices=["none", "json-schema"], default="none",
                     help="json-schema: every request is constrained by a JSON schema (bench_offline.BENCH_SCHEMAS)")
    off.add_argument("--json-schema", choices=["free-text", "fixed-keys", "both"], default="both",
                     help="which schema: free-text (strings, numbers, enums), fixed-keys (records of enums and "
                          "booleans: mostly forced tokens), both (each in turn, with --compare-unconstrained)")
    off.add_argument("--structured-forced-tokens", type=int, default=None,
                     help="forced tokens appended without a forward each, at most this many in a row (jump-forward; "
                          "default 32); 0: every token sampled")
    off.add_argument("--compare-unconstrained", action="store_true",
                     help="with --structured-outputs: run the same load unconstrained first and report the ratio of "
                          "output throughputs (constrained_over_unconstrained, per schema)")
    off.set_defaults(func=run_offline_cmd)
    srv = modes.add_parser("serve", help="a streaming load client against a running server")
    srv.add_argument("--url", default="http://127.0.0.1:8000")
    srv.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--vocab-size", type=int, default=None, help="for random prompt ids (default: from server)")
    srv.add_argument("--request-rate", type=float, default=None, help="requests/s, Poisson (default: all at once)")
    srv.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    srv.add_argument("--duration", type=float, default=600.0, help="stop sending after this many seconds")
    srv.add_argument("--disconnect-prob", type=float, default=0.0, help="fraction of clients that hang up early")
    srv.add_argument("--slo-ttft-ms", type=float, default=None)
    srv.add_argument("--slo-tpot-ms", type=float, default=None)
    _add_load_args(srv)
    srv.set_defaults(func=run_serve_cmd)


def _add_load_args(p) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean*(1 +- r)")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def _metadata(args) -> dict:
    import torch
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"command": " ".join(sys.argv), "commit": commit or "unknown", "date": time.strftime("%Y-%m-%d %H:%M"),
            "gpu": gpu, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}


def run_offline_cmd(args) -> int:
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.server.cli.bench_offline import (BENCH_SCHEMAS, compare_structured,
                                                      decode_bytes_per_step, format_summary,
                                                      measure_copy_bandwidth, run_offline, write_json)
    from quant_serve.server.cli.engine_args import engine_config_from_args
    config = engine_config_from_args(args)
    if args.structured_forced_tokens is not None:
        config.structured_forced_tokens = args.structured_forced_tokens
    engine = LLMEngine(config)
    result = {"metadata": _metadata(args), "model": engine.config.model,
              "quantization": engine.quant_config.describe() if engine.quant_config else "none",
              "kv_cache_dtype": engine.config.cache.kv_cache_dtype, "activations": engine.activations.to_json(),
              "kv_cache_tokens": engine.block_manager.num_blocks * engine.config.cache.block_size}
    schemas = ["free-text", "fixed-keys"] if args.json_schema == "both" else [args.json_schema]
    if args.structured_outputs == "json-schema":
        result["structured_outputs"], result["json_schemas"] = args.structured_outputs, schemas
    if args.structured_outputs == "json-schema" and args.compare_unconstrained:
        result.update(compare_structured(engine, schemas, args.num_prompts, args.input_len, args.output_len,
                                         args.range_ratio, args.bench_seed))
    else:
        structured = None
        if args.structured_outputs == "json-schema":
            from quant_serve.engine.sample.structured import StructuredOutputsParams
            structured = StructuredOutputsParams(json=BENCH_SCHEMAS[schemas[0]])
        result.update(run_offline(engine, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                  args.bench_seed, structured_outputs=structured))
    result["decode_bytes_per_step"] = decode_bytes_per_step(engine.model)
    spec = engine.spec_stats
    if engine.config.speculative.enabled:
        result["speculative"] = {"method": engine.config.speculative.method,
                                 "num_speculative_tokens": engine.config.speculative.num_speculative_tokens,
                                 "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                                 "num_accepted_tokens": spec.num_accepted_tokens,
                                 "acceptance_rate": spec.acceptance_rate,
                                 "mean_accepted_length": spec.mean_accepted_length,
                                 "accepted_per_pos": list(spec.accepted_per_pos)}
    if args.measure_bandwidth and engine.device != "cpu":
        bandwidth = measure_copy_bandwidth()
        result["copy_bandwidth_bytes_s"] = bandwidth
        result["roofline_tok_s"] = bandwidth / result["decode_bytes_per_step"]
        if "decode_tok_s" in result:
            result["roofline_fraction"] = result["decode_tok_s"] / result["roofline_tok_s"]
    print(json.dumps(result, indent=2))
    print(format_summary("Offline Benchmark Result", result), file=sys.stderr)   # stdout stays JSON for pipes
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def run_serve_cmd(args) -> int:
    import httpx
    from quant_serve.server.cli.bench_offline import format_summary, write_json
    from quant_serve.server.cli.bench_serve import run_load
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model or httpx.get(f"{args.url}/v1/models", headers=headers).json()["data"][0]["id"]
    vocab = args.vocab_size or httpx.get(f"{args.url}/tokenizer_info", headers=headers).json().get("vocab_size")
    result = asyncio.run(run_load(
        args.url, model, args.num_prompts, args.input_len, args.output_len, vocab, args.request_rate,
        args.concurrency, args.duration, args.bench_seed, args.range_ratio, args.disconnect_prob, args.api_key,
        args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None, args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None))
    result = {"metadata": _metadata(args), "url": args.url, "model": model, **result}
    print(json.dumps(result, indent=2))
    print(format_summary("Serving Benchmark Result", result), file=sys.stderr)
    if args.output_json:
        write_json(args.output_json, result)
    return 0 if result["server_errors_5xx"] == 0 else 1
