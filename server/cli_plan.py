"""`quant-serve plan MODEL`: what fits on this card, from config.json (and safetensors headers, or a GGUF's tensor
table) alone."""
import argparse
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan GPU memory (weights, activations, KV capacity) without loading the model")
    p.add_argument("model", help="model directory (config.json is enough), .gguf file, hub id (only its config is "
                                 "fetched; org/name:Q4_K_M for a GGUF repo) or a bundled config: "
                                 "qwen2.5-7b-instruct, llama-3.1-8b-instruct")
    from quant_serve.kernels.gpu import PROFILES
    p.add_argument("--gpu", default=None, choices=sorted(PROFILES),
                   help="the card: its memory (unless --gpu-memory-gb) and a projected decode speed (tok/s at batch "
                        "1 and 32, from the efficiency measured on an H200 under that card's kernel profile)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="card memory in GiB (as serve --gpu-memory-gb; default: the --gpu card's, else 24)")
    p.add_argument("--gpu-mem-gb", dest="gpu_memory_gb", type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)       # the old name, kept for scripts that use it
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: as stored)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graph reserve")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="plan for serve --quantize-lm-head (an INT4 g128 head instead of the float one)")
    p.add_argument("--speculative-model", default=None,
                   help="plan for serve --speculative-model: the draft's weights and its KV cache beside the target's")
    p.add_argument("--quantization", default=None,
                   help="gguf:Q4_K_M: plan random weights of that GGUF type mix (serve --load-format dummy); a GGUF "
                        "file's own types are read from its tensor table")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from quant_serve.engine.loader import resolve_model_dir
    from quant_serve.engine.memory import format_plan, plan_memory
    from quant_serve.engine.projection import project_decode
    from quant_serve.kernels.gpu import PROFILES
    caps = PROFILES[args.gpu] if args.gpu else None
    memory_gb = args.gpu_memory_gb or (caps.memory_gib if caps else 24.0)
    model_dir = resolve_model_dir(args.model, config_only=True)
    plan = plan_memory(model_dir, gpu_mem_gb=memory_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       enforce_eager=args.enforce_eager, weights_dtype=args.dtype, int4_head=args.quantize_lm_head,
                       quantization=args.quantization,
                       draft_model=resolve_model_dir(args.speculative_model, config_only=True) if args.speculative_model else None)
    projection = project_decode(plan, caps) if caps else None
    if args.json:
        json.dump({**plan.to_dict(), **({"projection": projection} if projection else {})}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(plan))
        if projection:
            print(f"projected decode on {projection['gpu']} ({projection['bandwidth_gbs']:.0f} GB/s, "
                  f"{projection['context']:,}-token contexts): batch 1 {projection['batch1_tok_s']:.0f} tok/s, "
                  f"batch 32 {projection['batch32_tok_s']:.0f} tok/s  (a projection: efficiency "
                  f"{projection['efficiency']}, {projection['source']})")
    if not plan.fits:
        print(f"error: {plan.error_message()}", file=sys.stderr)
        return 1
    return 0
