"""`quant-serve kernels --explain`: per layer and batch size, which kernel runs on a GPU, its configuration and why.

The answer comes from the same functions the forward pass asks (kernels/matmul/plan.py, kernels/matmul/plan.py,
kernels/attention/paged.py)
under the GPU's capability record (kernels/gpu.py): a named card's profile, or `this` GPU. Nothing is loaded but
config.json; it runs on a machine without a GPU.
"""
import dataclasses
import json
import sys

DEFAULT_MS = "1,2,8,16,32,64,128,256,1024,4096"
# --weight-format: what a layer's weights are, and so which plan answers
WEIGHT_FORMATS = {
    "w4": "INT4 with integer zero points or symmetric (AWQ, GPTQ, compressed-tensors)",
    "w4-offsets": "INT4 with float per-group offsets (GGUF Q4_0 / Q4_1, a Q4_K shard merged with them)",
    "w4-kquant": "INT4 with GGUF Q4_K's two-level scales as stored (int16 sub-codes per 32, fp16 d and dmin per 256; "
                 "a layer of Q4_K shards)",
    "w8": "int8 codes with float scales and offsets (GGUF Q8_0 / Q5_0 / Q5_1, Q5_K / Q6_K merged with those)",
    "q6k": "GGUF Q6_K at 6 bits (a layer of Q6_K shards): with fp16 activations in the W4A16 fragment layout "
           "(low nibbles as INT4 words, the top 2 bits beside them, fp16 d * sc per 16; 7 bits), read by the W4A16 "
           "tensor-core kernels; with bf16 code planes, int8 sub-scales per 16, fp16 d per 256, read by the W8A16 "
           "kernels",
    "q5k": "GGUF Q5_K at 5 bits (a layer of Q5_K shards): with fp16 activations in the W4A16 fragment layout "
           "(low nibbles as INT4 words, the top bit beside them, fp16 (s, o) per 32; 6 bits), read by the W4A16 "
           "tensor-core kernels; with bf16 4-bit + 1-bit code planes, Q4_K's two-level scales (int16 sub-codes per "
           "32, int32 d | dmin per 256), read by the W8A16 kernels",
}
W8_FORMATS = ("w8", "q6k", "q5k")


def register(sub) -> None:
    from quant_serve.kernels.gpu import PROFILE_NAMES
    p = sub.add_parser("kernels", help="which kernel runs for each layer and batch size on a GPU, and why")
    p.add_argument("--explain", action="store_true", help="print the kernel plan (the only action, for now)")
    p.add_argument("--gpu", default="a10", choices=PROFILE_NAMES,
                   help="the card to plan for (a named profile), or `this` GPU (default: a10)")
    p.add_argument("--model", default=None, help="model directory with config.json, hub id (only its config is "
                                                 "fetched) or a bundled config (qwen2.5-7b-instruct, "
                                                 "llama-3.1-8b-instruct); default: the bundled demo model")
    p.add_argument("--m", default=DEFAULT_MS, help=f"rows (tokens) per matmul to plan for (default: {DEFAULT_MS})")
    p.add_argument("--group-size", type=int, default=None, help="weight group size (default: the checkpoint's, "
                                                                "else 128; 32 for the GGUF formats)")
    p.add_argument("--weight-format", default="w4", choices=list(WEIGHT_FORMATS),
                   help="the layers' weights: " + "; ".join(f"{k}: {v}" for k, v in WEIGHT_FORMATS.items()))
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"], help="activation dtype")
    p.add_argument("--activation-dtype", default="auto", choices=["auto", "fp16", "int8"],
                   help="activations of the INT4 layers: int8 (quantized on the fly, integer tensor cores: "
                        "kernels/w4a8) where the kernel reads the weights, fp16, or auto (int8 where the plan says it "
                        "pays and the format passed the accuracy gate: kernels/matmul/int8/rules.py)")
    p.add_argument("--act-scale", default="group", choices=["group", "token"],
                   help="int8 activations: one scale per token and weight group, or per token")
    p.add_argument("--context", type=int, default=4096, help="decode context (tokens) for the attention rows")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(K, N) of the merged linear layers the decoder builds (engine/models/decoder.py)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (cfg.hidden_size, q + 2 * kv), "o_proj": (q, cfg.hidden_size),
            "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}


def explain(caps, options, cfg, ms: list[int], group_size: int, dtype, context: int,
            weight_format: str = "w4") -> dict:
    """The whole plan as a dict: the GPU, the weight format, the quantized layers (layout, then kernel per M),
    decode attention."""
    import torch

    from quant_serve.kernels.attention.kv_int import int_kv_exact_tokens, int_kv_format
    from quant_serve.kernels.attention.kv_int_paged import NUM_STAGES as INT_NUM_STAGES, int_attention_tiles
    from quant_serve.kernels.attention.paged import DecodeConfig, decode_config, split_count
    from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_KQUANT, ZP_OFFSETS, ZP_Q5, ZP_Q6
    from quant_serve.kernels.matmul.plan import layout_for, plan_w4a16
    from quant_serve.kernels.matmul.rules import measured_on
    from quant_serve.kernels.matmul.plan import plan_w8a16
    rules = measured_on(caps.family) or f"derived for {caps.family} (no table measured on this family)"
    # as W8Linear holds Q6_K / Q5_K on CUDA fp16: the fragment layout
    frag_hi = weight_format in ("q6k", "q5k") and dtype == torch.float16
    w8 = weight_format in W8_FORMATS and not frag_hi
    zp_mode = {"w4-offsets": ZP_OFFSETS, "w4-kquant": ZP_KQUANT, "q6k": ZP_Q6, "q5k": ZP_Q5}.get(weight_format,
                                                                                               ZP_INT4)
    out = {"gpu": dataclasses.asdict(caps), "options": dataclasses.asdict(options),
           "weight_format": weight_format, "weight_format_why": WEIGHT_FORMATS[weight_format],
           "rules": "W8A16: derived, not measured (kernels/matmul/plan.py)" if w8 else rules,
           "layers": [], "attention": []}
    for name, (k, n) in layer_shapes(cfg).items():
        if weight_format == "w8":
            layout, why = "int8", "int8 codes [K, N], scales / offsets [G, N] (kernels/matmul/reference_planes.py)"
        elif frag_hi and weight_format == "q6k":
            layout, why = "frag", "Q6_K in the fragment layout (kernels/matmul/frag/q6k.py: 7 bits; the planes convert " \
                                  "at load where the device's Q6_K probe passes)"
        elif frag_hi:
            layout, why = "frag", "Q5_K in the fragment layout (kernels/matmul/frag/q5k.py: 6 bits; the planes convert " \
                                  "at load where the device's Q5_K probe passes)"
        elif weight_format == "q6k":
            layout, why = "q6k-planes", "4-bit + 2-bit code planes, int8 sub-scales, fp16 d (kernels/matmul/planes/q6k.py)"
        elif weight_format == "q5k":
            layout, why = "q5k-planes", "4-bit + 1-bit code planes, int16 sub-codes, int32 d | dmin " \
                                        "(kernels/matmul/planes/q5k.py)"
        elif weight_format == "w4-kquant":
            layout, why = layout_for(k, n, 32, dtype, caps, options, True)
            why += "; Q4_K's two-level scales (ZP_MODE 3 / OFFSETS 2 in every kernel: s = d * sc, o = -dmin * m " \
                   "formed per group in fp32; kernels/matmul/frag/kquant.py)"
        else:
            layout, why = layout_for(k, n, group_size, dtype, caps, options, weight_format == "w4-offsets")
            if weight_format == "w4-offsets":
                why += "; float offsets dequantized as q * s + o (the row layout where the device's offset probe " \
                       "of the fragment kernels fails)"
        rows = []
        for m in ms:
            p = plan_w8a16(m, k, n, {"q6k": 16, "q5k": 32}.get(weight_format, group_size), caps.sms,
                           weight_format if weight_format in ("q6k", "q5k") else "int8") \
                if w8 else plan_w4a16(m, k, n, caps, options, layout, dtype, name == "gate_up_proj", zp_mode=zp_mode,
                                      group_size=32 if weight_format == "w4-kquant" else group_size)
            rows.append({"m": m, "kernel": p.kernel, "why": p.why,
                         "config": dataclasses.asdict(p.config) if p.config else None})
        out["layers"].append({"name": name, "k": k, "n": n, "layout": layout, "layout_why": why, "plans": rows})
    for kv in ("fp16", "fp8_e4m3", "fp8_e5m2"):
        for batch in (1, 8, 64, 256):
            programs = batch * cfg.num_kv_heads
            dc = decode_config(kv != "fp16", programs, context)
            fp8_note = "" if kv == "fp16" else (" widened by cvt.e4m3x2 asm" if dc.fp8_asm and caps.fp8_cvt else
                                               " widened in software (no fp8 cvt)" if not caps.fp8_cvt else "")
            out["attention"].append({"kv": kv, "batch": batch, "context": context, "programs": programs,
                                     "splits": split_count(programs, context, caps.sms, dc),
                                     "config": dataclasses.asdict(dc), "note": fp8_note.strip()})
    group = cfg.num_heads // cfg.num_kv_heads
    for kv in ("int8", "int4"):
        fmt = int_kv_format(kv, cfg.head_dim)
        exact = int_kv_exact_tokens(kv)
        _, block_n = int_attention_tiles(True, exact > 0, 64, group)
        tiles = "scores and values on the codes (kv_int_tiles.py)" if fmt.group == cfg.head_dim else \
            "tiles dequantized in registers"
        why = f"{fmt.describe(cfg.head_dim, exact)}: {tiles}; RoPE, rotation and store in one prologue kernel" + \
            ("; the window's tiles dequantized, in one stage" if exact else "")
        for batch in (1, 8, 64, 256):
            programs = batch * cfg.num_kv_heads
            out["attention"].append({"kv": kv, "batch": batch, "context": context, "programs": programs,
                                     "splits": split_count(programs, context, caps.sms, DecodeConfig()),
                                     "config": {"block_n": block_n, "num_stages": INT_NUM_STAGES, "fp8_asm": False},
                                     "note": why})
    return out


def _config_text(cfg: dict | None) -> str:
    if not cfg:
        return "-"
    defaults_dropped = {k: v for k, v in cfg.items() if v not in (False, 0, None)}
    return " ".join(f"{k}={v}" for k, v in defaults_dropped.items())


def format_explain(plan: dict, model_name: str) -> str:
    g = plan["gpu"]
    lines = [f"GPU: {g['name']} ({'profile ' + g['profile'] if g['profile'] != 'this' else 'this device'}: "
             f"sm{g['arch'][0]}{g['arch'][1]}, {g['sms']} SMs, {g['smem_per_block'] // 1024} KB shared memory a "
             f"block, {g['bandwidth_gbs']:.0f} GB/s; TMA {'yes' if g['tma'] else 'no'}, wgmma "
             f"{'yes' if g['wgmma'] else 'no'}, PDL {'yes' if g['pdl'] else 'no'}, fp8 cvt "
             f"{'yes' if g['fp8_cvt'] else 'no'})",
             f"weights: {plan['weight_format']} ({plan['weight_format_why']})",
             f"rules: {plan['rules']}", f"model: {model_name}", ""]
    for layer in plan["layers"]:
        lines.append(f"{layer['name']}  K={layer['k']} N={layer['n']}  layout {layer['layout']}: "
                     f"{layer['layout_why']}")
        for r in layer["plans"]:
            lines.append(f"  M={r['m']:<5} {r['kernel']:<15} {_config_text(r['config']):<60} {r['why']}")
        lines.append("")
    lines.append(f"decode attention at {plan['attention'][0]['context']} tokens of context:")
    for a in plan["attention"]:
        c = a["config"]
        lines.append(f"  {a['kv']:<9} batch {a['batch']:<4} {a['programs']:>5} programs  {a['splits']:>3} split(s)  "
                     f"block_n={c['block_n']} stages={c['num_stages']}"
                     f"{' fp8_asm' if c['fp8_asm'] else ''}{'  ' + a['note'] if a['note'] else ''}")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from quant_serve.engine.load.loader import load_model_config, resolve_model_dir
    from quant_serve.kernels.gpu import PROFILES, KernelOptions, caps_of_device, resolve_caps
    from quant_serve.server.cli.engine_args import demo_model_dir
    if args.gpu == "this":
        if not torch.cuda.is_available():
            raise ValueError("no CUDA GPU here: name the card to plan for, e.g. --gpu a10")
        caps = resolve_caps(caps_of_device(torch.cuda.current_device()), "this")
    else:
        caps = PROFILES[args.gpu]
    model_dir = resolve_model_dir(args.model or demo_model_dir(), config_only=True)
    cfg, _ = load_model_config(model_dir)
    q = cfg.quantization_config or {}
    gguf = args.weight_format != "w4"
    group_size = args.group_size or (32 if gguf else q.get("group_size") or q.get("q_group_size") or 128)
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    options = KernelOptions(activation_dtype=args.activation_dtype, act_scale=args.act_scale)
    plan = explain(caps, options, cfg, ms, group_size, getattr(torch, args.dtype), args.context, args.weight_format)
    if args.json:
        json.dump(plan, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_explain(plan, f"{model_dir} ({cfg.architecture}, group size {group_size})"))
    return 0
