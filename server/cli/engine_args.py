"""The engine's command-line flags (named like vLLM's) and the EngineConfig they make, shared by every subcommand
that builds an engine (generate, serve, bench, kernels)."""
import argparse

import json

from quant_serve.engine.config import (OFFLINE_BATCHED_TOKENS, SERVE_BATCHED_TOKENS, SPEC_DISABLE_BATCH_SIZE,
                                       CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig)
from quant_serve.kernels.gpu import ACTIVATION_DTYPES, KernelOptions
from quant_serve.kernels.matmul.reference_int8 import ACT_SCALES
from quant_serve.server.cli.lora_args import add_lora_args, lora_config_from_args

ACTIVATION_HELP = ("activations of the quantized layers: fp16 (W4A16 / W8A16), int8 (quantized on the fly: W4A8 / "
                   "W8A8; for now on the CPU path's torch twins only), auto (int8 only where the weight format met "
                   "the accuracy gate of kernels/matmul/int8/eligibility.py); the start-up log names what each layer runs")
EXACT_HELP = ("--kv-cache-dtype int8/int4: each sequence's last N tokens of K/V are also kept unquantized and read "
              "exact by attention (default: 24 for int4, 0 for int8; 0 = off). Costs max_num_seqs x N tokens of "
              "model-dtype memory; verification steps (speculative decoding) run eagerly with it")
ACT_SCALE_HELP = ("int8 activations: one scale per token (token) or per token and weight group (group: finer, "
                  "GGUF's groups of 32 as llama.cpp's Q8_1)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a default only where it says something: not for options without one (None), not for store_true /
    store_false flags (their help says what they do); --x/--no-x pairs read "(default: on)" or "(default: off)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction) and help:
            return help + (" (default: on)" if action.default else " (default: off)")
        if ("%(default)" in help or action.default is None or action.default is argparse.SUPPRESS
                or not action.option_strings or action.nargs == 0):
            return help
        return help + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """Every subcommand's parser: HelpFormatter unless a command picks its own."""

    def __init__(self, *args, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def demo_model_dir() -> str | None:
    from quant_serve.engine.load.demo import DEMO_MODEL_DIR
    return str(DEMO_MODEL_DIR) if (DEMO_MODEL_DIR / "config.json").is_file() else None


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model directory, .gguf file or hub id (org/name, or org/name:Q4_K_M for one "
                            "quantization of a GGUF repo; default: the bundled demo model)")
    p.add_argument("--model", default=None,
                   help="model directory, .gguf file (or a directory holding one) or hub id (org/name, or "
                        "org/name:Q4_K_M for one quantization of a GGUF repo; default: the bundled demo model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32", "half", "float"])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--quantization", "-q", default=None,
                   help="override the detected quantization: awq, gptq, compressed-tensors, none; with "
                        "--load-format dummy also gguf:Q4_K_M (random weights with llama.cpp's Q4_K_M type mix)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="INT4 g128 copy of the output head at load (round-to-nearest): the largest matrix a decode "
                        "step reads; quant-serve eval --quantize-lm-head measures what it costs")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step's batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget per step (default: {SERVE_BATCHED_TOKENS} for serve, "
                        f"{OFFLINE_BATCHED_TOKENS} for offline commands, as vLLM on cards under 70 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="fraction of the card's memory the engine may plan for")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
    p.add_argument("--kv-exact-tokens", type=int, default=None, help=EXACT_HELP)
    p.add_argument("--activation-dtype", default="auto", choices=ACTIVATION_DTYPES, help=ACTIVATION_HELP)
    p.add_argument("--act-scale", default="group", choices=ACT_SCALES, help=ACT_SCALE_HELP)
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="plan for (and cap the allocator at) a card of this many GiB, e.g. 24 to emulate a 24 GB card")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV pool size in GiB (default: planned on CUDA, 1 GiB on CPU)")
    p.add_argument("--kv-scale-source", default="auto",
                   choices=["auto", "checkpoint", "file", "first-prompt", "unit"],
                   help="where FP8 KV scales come from (auto: checkpoint, then kv_scales.json, then the first prompt)")
    p.add_argument("--cpu-kv-gb", type=float, default=0.0,
                   help="host-memory tier for KV blocks of preempted sequences and evicted prefix blocks")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix seen before")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps' token budgets")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and launch each step while the previous one still runs "
                        "(--no-async-scheduling: resolve every step before scheduling the next)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding as in vLLM, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": '
                        'DIR, "num_speculative_tokens": 4}\'; the flags below override its keys')
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens proposed per step and verified in one forward (0: off; default: off)")
    p.add_argument("--speculative-model", default=None,
                   help="draft model (same tokenizer) for draft_model speculation; 'ngram' for prompt lookup")
    p.add_argument("--speculative-disable-batch-size", type=int, default=None,
                   help=f"speculation off while more sequences than this are unfinished "
                        f"(default: {SPEC_DISABLE_BATCH_SIZE}, from bench/spec_decode.py verify-cost)")
    add_lora_args(p)


def batched_tokens(args) -> int:
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return SERVE_BATCHED_TOKENS if getattr(args, "command", None) == "serve" else OFFLINE_BATCHED_TOKENS


# vLLM's --speculative-config keys (and its older flag names) -> SpeculativeConfig fields
_SPEC_KEYS = {"method": "method", "num_speculative_tokens": "num_speculative_tokens", "model": "model",
              "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
              "disable_by_batch_size": "disable_by_batch_size", "backoff_after": "backoff_after"}


def speculative_config_from_args(args) -> SpeculativeConfig:
    fields: dict = {}
    if getattr(args, "speculative_config", None):
        try:
            given = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --speculative-config is not valid JSON: {e}")
        if not isinstance(given, dict):
            raise SystemExit("error: --speculative-config must be a JSON object")
        unknown = sorted(set(given) - set(_SPEC_KEYS))
        if unknown:
            raise SystemExit(f"error: --speculative-config has unknown keys {unknown} (known: {sorted(_SPEC_KEYS)})")
        fields = {_SPEC_KEYS[k]: v for k, v in given.items()}
    model = getattr(args, "speculative_model", None)
    if model == "ngram" or model == "[ngram]":
        fields["method"] = "ngram"
    elif model:
        fields["method"], fields["model"] = "draft_model", model
    if getattr(args, "num_speculative_tokens", None) is not None:
        fields["num_speculative_tokens"] = args.num_speculative_tokens
    if getattr(args, "speculative_disable_batch_size", None) is not None:
        fields["disable_by_batch_size"] = args.speculative_disable_batch_size
    if fields.get("method") in ("ngram", "draft_model") and "num_speculative_tokens" not in fields:
        raise SystemExit("error: speculative decoding needs num_speculative_tokens (--num-speculative-tokens)")
    try:
        return SpeculativeConfig(**fields)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: speculative config: {e}")


def engine_config_from_args(args) -> EngineConfig:
    model = getattr(args, "model_tag", None) or args.model or demo_model_dir()
    if model is None:
        raise SystemExit("error: no --model given and the bundled demo model is not installed")
    return EngineConfig(
        model=model, tokenizer=args.tokenizer, revision=args.revision, dtype=args.dtype, device=args.device,
        load_format=args.load_format, quantization=args.quantization, seed=args.seed,
        quantize_lm_head=args.quantize_lm_head,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, max_model_len=args.max_model_len,
        cache=CacheConfig(num_gpu_blocks=args.num_gpu_blocks_override, kv_cache_dtype=args.kv_cache_dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory_gb=args.kv_cache_memory_gb, gpu_memory_gb=args.gpu_memory_gb,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_scale_source=args.kv_scale_source, cpu_kv_gb=args.cpu_kv_gb,
                          kv_exact_tokens=args.kv_exact_tokens),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched_tokens(args),
                                  enable_chunked_prefill=args.enable_chunked_prefill),
        kernels=KernelOptions(activation_dtype=args.activation_dtype, act_scale=args.act_scale),
        speculative=speculative_config_from_args(args), lora=lora_config_from_args(args))
