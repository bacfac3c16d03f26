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
                   help="the card: its memory (unless --gpu-memory-gb) and projected speeds from the card model "
                        "(engine/plan/card_model.py: each kernel of a step timed from the card's bandwidth and tensor "
                        "rates with efficiencies fitted on H100 / H200 runs): decode tok/s at batch 1 and 32, "
                        "prefill tok/s of 512- and 4096-token prompts")
    p.add_argument("--context", type=int, default=1024,
                   help="--gpu: tokens of context each decoding sequence holds (default 1024)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="card memory in GiB (as serve --gpu-memory-gb; default: the --gpu card's, else 24)")
    p.add_argument("--gpu-mem-gb", dest="gpu_memory_gb", type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)       # the old name, kept for scripts that use it
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4"])
    p.add_argument("--kv-exact-tokens", type=int, default=None,
                   help="int8/int4 cache: plan for serve --kv-exact-tokens (default: the dtype's, 24 for int4)")
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
    p.add_argument("--enable-lora", action="store_true", help="plan for serve --enable-lora: the adapters' slots")
    p.add_argument("--max-loras", type=int, default=1, help="--enable-lora: adapters on the device at once")
    p.add_argument("--max-lora-rank", type=int, default=16, help="--enable-lora: the largest rank the slots take")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="--enable-lora: adapters kept in host memory (default: --max-loras); printed, not planned")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from quant_serve.engine.load.loader import resolve_model_dir
    from quant_serve.engine.plan.memory import format_plan, plan_memory
    from quant_serve.engine.plan.card_model import projection_for
    from quant_serve.kernels.gpu import PROFILES
    caps = PROFILES[args.gpu] if args.gpu else None
    memory_gb = args.gpu_memory_gb or (caps.memory_gib if caps else 24.0)
    model_dir = resolve_model_dir(args.model, config_only=True)
    plan = plan_memory(model_dir, gpu_mem_gb=memory_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                       kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       enforce_eager=args.enforce_eager, weights_dtype=args.dtype, int4_head=args.quantize_lm_head,
                       quantization=args.quantization, kv_exact_tokens=args.kv_exact_tokens,
                       lora_bytes=_lora_slot_bytes(args, model_dir),
                       draft_model=resolve_model_dir(args.speculative_model, config_only=True) if args.speculative_model else None)
    projection = projection_for(model_dir, caps, args.quantization, args.kv_cache_dtype, args.quantize_lm_head,
                                args.context, args.max_num_batched_tokens) if caps else None
    if args.json:
        json.dump({**plan.to_dict(), **({"projection": projection} if projection else {})}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(plan))
        if args.enable_lora:
            cpu = args.max_cpu_loras or args.max_loras
            print(f"LoRA host memory: up to {cpu} adapters x {_lora_slot_bytes(args, model_dir, 1) / 2**20:.1f} "
                  f"MiB (rank {args.max_lora_rank} on every projection)")
        if projection:
            print(format_projection(projection))
    if not plan.fits:
        print(f"error: {plan.error_message()}", file=sys.stderr)
        return 1
    return 0


def _lora_slot_bytes(args, model_dir, max_loras: int | None = None) -> int:
    """The device bytes of --max-loras slots (engine/lora/manager.py:slot_bytes, as the engine plans them), or of
    max_loras adapters; 0 without --enable-lora."""
    if not args.enable_lora:
        return 0
    import torch

    from quant_serve.engine.config import LoRAConfig
    from quant_serve.engine.load.loader import load_model_config
    from quant_serve.engine.lora.manager import slot_bytes
    cfg, _ = load_model_config(model_dir)
    lora = LoRAConfig(enable_lora=True, max_loras=max_loras or args.max_loras, max_lora_rank=args.max_lora_rank)
    dtype = torch.float16 if args.dtype == "auto" else getattr(torch, args.dtype)
    return slot_bytes(cfg, lora, dtype)


def format_projection(pr: dict) -> str:
    """The three figures and the model's inputs (engine/plan/card_model.py project)."""
    i = pr["inputs"]
    rates = ", ".join(f"{d} {v:g}" for d, v in i["tensor_tflops"].items() if v)
    lines = [f"projected on {pr['gpu']} (a projection from the card model, not a measurement):"]
    for d in pr["decode"]:
        lines.append(f"  decode batch {d['batch']:>2}: {d['tok_s']:>8,.0f} tok/s  ({d['context']:,}-token contexts; "
                     f"{d['bytes'] / 1e9:.2f} GB a step, {d['launches']} launches, bound by {d['binds']})")
    for f in pr["prefill"]:
        lines.append(f"  prefill {f['prompt']:>5,} tokens: {f['tok_s']:>8,.0f} tok/s  ({f['chunks']} chunk(s) of <= "
                     f"{f['chunk']:,}; {f['tensor_ops'] / 1e12:.1f} T tensor ops, bound by {f['binds']})")
    lines += [f"  inputs: {i['bandwidth_gbs']:g} GB/s, {i['sms']} SMs at {i['boost_mhz']} MHz, tensor TFLOPS/TOPS "
              f"{rates}; weights {i['weight_bytes_per_step'] / 1e9:.2f} GB a step, KV "
              f"{i['kv_bytes_per_token']:,} B/token",
              f"  fitted ({i['constants']}): eta_mem {i['eta_mem']:.3f}, eta_tc {i['eta_tc']['fp16_f32acc']:.3f}, "
              f"launch {i['launch_us']:.2f} us, small launch {i['small_us']:.2f} us, step {i['step_us']:.1f} us; "
              f"SM bytes/clock {_short(i['sm_bytes_per_clock'])}; SM tensor ops/clock {_short(i['sm_ops_per_clock'])}"]
    return "\n".join(lines)


def _short(d: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in d.items())
