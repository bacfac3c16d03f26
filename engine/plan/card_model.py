"""Speed on a card we do not have: each kernel of a step timed from the card's datasheet rates and fitted
efficiencies, instead of one efficiency scaled by bandwidth (issue #53, item 3).

Per kernel (engine/plan/card_step.py lists a step's kernels: bytes, tensor operations and their dtype, family):

    t = max( bytes / (eta_mem x bandwidth),                    DRAM
             bytes / (sm_bytes[family] x SMs x clock),          what the SMs issue: bytes an SM moves per clock
             ops / (sm_ops[tile] x SMs x clock),                and tensor operations our mma.sync / wgmma
                                                                tiles issue per clock (with their dequantize)
             ops / (eta_tc[dtype] x tensor rate[dtype]) )       the card's tensor cores for that dtype / accumulator
        + launch                                                fixed: launch, ramp, tail (in a CUDA graph); a
                                                                small launch (norm, RoPE, SwiGLU) costs small_us

    step = sum of its kernels + step_fixed                      host work, input copies, sampling sync

The SM terms carry what bandwidth alone cannot: an H200 moves 18 bytes of DRAM per SM-clock, more than our kernels
keep in flight there (the H100 and H200 have the same SMs and clock but 3.35 / 4.8 TB/s, and a decode step is only
1.2x faster on the H200), while the cards our users own move 2.5-6.7 (A10 4.9, 3090 6.7, 4090 3.1, L4 2.5): there
DRAM binds. eta_mem, the SM terms, eta_tc, launch and step_fixed are fitted per kernel plan (engine/plan/card_fit.py) from
runs on the H100 and H200; engine/plan/card_params.py holds the fitted values and says which runs they came from.
"""
from __future__ import annotations

from pathlib import Path

from quant_serve.engine.plan.card_params import FITTED
from quant_serve.engine.plan.card_step import CardParams, Kernel, ModelShape, decode_kernels, prefill_kernels
from quant_serve.kernels.gpu import GPUCaps

DTYPES = ("fp16_f32acc", "fp16", "int8", "fp8")
TERMS = ("dram", "sm", "tensor")


def tensor_rate(caps: GPUCaps, dtype: str) -> float:
    """ops/s of the card's tensor cores for `dtype` (0 where it has none)."""
    return 1e12 * {"fp16_f32acc": caps.fp16_f32acc_tflops, "fp16": caps.fp16_tflops, "int8": caps.int8_tops,
                   "fp8": caps.fp8_tflops}[dtype]


def sm_ops_key(k: Kernel, sm_ops: dict) -> str:
    """The sm_ops entry of a kernel: its tile and weight family where fitted ("mma:gguf_q4_k"), else its tile's."""
    return next((key for key in (f"{k.tile}:{k.family}", k.tile) if k.tile and key in sm_ops), "")


def kernel_terms(k: Kernel, caps: GPUCaps, p: CardParams, sms: int | None = None) -> dict[str, float]:
    """Seconds of each bound of one kernel on `caps` (sms: the SMs its grid fills, when not the card's)."""
    sm_clock = (sms if k.grid_sized and sms else caps.sms) * caps.boost_mhz * 1e6
    terms = {"dram": k.nbytes / (p.eta_mem * caps.bandwidth_gbs * 1e9), "sm": 0.0, "tensor": 0.0}
    if k.family in p.sm_bytes:
        terms["sm"] = k.nbytes / (p.sm_bytes[k.family] * sm_clock)
    tile = sm_ops_key(k, p.sm_ops)
    if k.ops and tile:
        terms["sm"] = max(terms["sm"], k.ops / (p.sm_ops[tile] * sm_clock))
    if k.ops and k.dtype:
        rate = tensor_rate(caps, k.dtype)
        if rate <= 0:
            raise ValueError(f"{caps.name} has no {k.dtype} tensor rate (kernels/gpu.py PROFILES)")
        terms["tensor"] = k.ops / (p.eta_tc[k.dtype] * rate)
    return terms


def fixed_time(k: Kernel, p: CardParams) -> float:
    return (p.small_us if k.family == "small" else p.launch_us) * 1e-6


def kernel_time(k: Kernel, caps: GPUCaps, p: CardParams, sms: int | None = None) -> tuple[float, str]:
    """(seconds, the binding term) of one launch: the largest bound plus the launch's fixed time."""
    terms = kernel_terms(k, caps, p, sms)
    binding = max(terms, key=terms.get)
    return terms[binding] + fixed_time(k, p), binding


def step_time(kernels: list[Kernel], caps: GPUCaps, p: CardParams, sms: int | None = None) -> dict:
    """Seconds of one engine step made of `kernels`, with the bytes, operations and seconds each term binds."""
    total, bound, fixed = p.step_us * 1e-6, {t: 0.0 for t in TERMS}, p.step_us * 1e-6
    for k in kernels:
        t, binding = kernel_time(k, caps, p, sms)
        total += t
        fixed += fixed_time(k, p)
        bound[binding] += t - fixed_time(k, p)
    return {"seconds": total, "launches": len(kernels), "bytes": sum(k.nbytes for k in kernels),
            "tensor_ops": sum(k.ops for k in kernels), "fixed_s": fixed,
            **{f"{t}_bound_s": s for t, s in bound.items()}}


def binding_term(step: dict) -> str:
    """Which term takes most of a step: dram, sm, tensor or fixed (launches and the step's host time)."""
    shares = {t: step[f"{t}_bound_s"] for t in TERMS} | {"fixed": step["fixed_s"]}
    return max(shares, key=shares.get)


def decode_tok_s(shape: ModelShape, caps: GPUCaps, p: CardParams, batch: int, context: int) -> dict:
    step = step_time(decode_kernels(shape, caps, batch, context), caps, p)
    return {"tok_s": batch / step["seconds"], "batch": batch, "context": context, "binds": binding_term(step),
            **step}


def prefill_tok_s(shape: ModelShape, caps: GPUCaps, p: CardParams, prompt: int, chunk: int) -> dict:
    """One prompt of `prompt` tokens prefilled in chunks of at most `chunk` (the engine's token budget)."""
    steps = [step_time(prefill_kernels(shape, caps, min(chunk, prompt - start), start), caps, p)
             for start in range(0, prompt, chunk)]
    total = {key: sum(s[key] for s in steps) for key in steps[0]}
    return {"tok_s": prompt / total["seconds"], "prompt": prompt, "chunk": chunk, "chunks": len(steps),
            "binds": binding_term(total), **total}


def project(shape: ModelShape, caps: GPUCaps, p: CardParams, context: int, batches=(1, 32),
            prompts=(512, 4096), chunk: int = 2048) -> dict:
    """decode tok/s at each batch (sequences of `context` tokens) and prefill tok/s of each prompt, with the inputs
    (rates, fitted constants, bytes a step reads, which term binds)."""
    return {
        "gpu": caps.name, "profile": caps.profile, "model": shape.name,
        "inputs": {"bandwidth_gbs": caps.bandwidth_gbs, "sms": caps.sms, "boost_mhz": caps.boost_mhz,
                   "tensor_tflops": {d: tensor_rate(caps, d) / 1e12 for d in DTYPES},
                   "eta_mem": p.eta_mem, "eta_tc": p.eta_tc, "sm_bytes_per_clock": p.sm_bytes,
                   "sm_ops_per_clock": p.sm_ops, "launch_us": p.launch_us, "small_us": p.small_us,
                   "step_us": p.step_us,
                   "weight_bytes_per_step": shape.step_weight_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token,
                   "fitted_on": p.source, "derived": p.derived},
        "decode": [decode_tok_s(shape, caps, p, b, context) for b in batches],
        "prefill": [prefill_tok_s(shape, caps, p, n, chunk) for n in prompts],
    }


def params_for(caps: GPUCaps) -> tuple[CardParams, str]:
    """The fitted constants of the plan `caps`' card runs, and where they come from: sm90 runs its own plan; the
    sm86 plan is also what the sm89 cards (4090, L4: the sm86 plan with hardware fp8 conversion) and the A100 run."""
    plan = "sm90" if caps.family == "sm90" else "sm86"
    how = f"the {plan} fit" + ("" if caps.family == plan else f" ({caps.family} runs the sm86 kernel plan)")
    return FITTED[plan], how


def projection_for(model_dir, caps: GPUCaps, quantization: str | None = None, kv_cache_dtype: str = "auto",
                   int4_head: bool = False, context: int = 1024, chunk: int = 2048) -> dict:
    """`plan --gpu`'s projection for a model directory (config.json; a GGUF file's tensor table; --quantization
    gguf:MIX for a dummy mix)."""
    from quant_serve.engine.plan.card_step import model_shape
    from quant_serve.engine.plan.memory import _load_config, kv_dtype_bytes
    cfg, _ = _load_config(model_dir)
    if kv_cache_dtype.startswith("int"):
        raise ValueError(f"plan --gpu: the card model has no measurements of --kv-cache-dtype {kv_cache_dtype} "
                         "attention (GPU timings of the integer KV kernels are not taken yet); project with fp8 "
                         "or leave out --gpu for the memory plan alone")
    kv = kv_dtype_bytes(kv_cache_dtype, cfg.get("dtype") or cfg.get("torch_dtype"))
    shape = model_shape(cfg, quantization, kv, int4_head, Path(str(model_dir)).name)
    params, how = params_for(caps)
    out = project(shape, caps, params, context, chunk=chunk)
    out["inputs"]["constants"] = how
    return out
