"""Measured runs as the card fit's observations (engine/card_fit.py): bench/card_model.py's JSON, and until the H100
and H200 have run it at one commit, the committed bench/results files it replaces, which came from DIFFERENT
commits (each observation names its file and commit).

Kernel benchmarks (bench/kernel_speed.py, bench/gguf_kernel_speed.py) give one observation per layer shape, M and
path (FP16 cuBLAS, our INT4 kernel as the JSON names it, a GGUF format) and per decode-attention point; end-to-end
runs (bench/e2e.py) one per batch-1 and batch-32 decode step (128-token prompts, 256 generated: 256 tokens of
context on average).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

from quant_serve.engine.card_fit import Observation, plan_caps
from quant_serve.engine.card_step import (Kernel, Matmul, attention_family, decode_kernels, launches, model_shape,
                                           prefill_kernels)

CONFIGS = Path(__file__).resolve().parent / "configs"
SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584),
          "v": (3584, 512), "head": (3584, 152064)}             # Qwen2.5-7B, bench/kernel_speed.py
# FP16 layers enter the fit where the projections use them: the head, and the large shapes prefill's dequantize +
# cuBLAS path multiplies. cuBLAS runs the small ones (qkv, o, v) as split-K GEMVs with a reduce launch, a heuristic
# of its own that the model does not follow.
FP16_SHAPES = ("gate_up", "down", "head")
E2E_CONTEXT = 128 + 256 // 2
WEIGHTS = {"step": 8.0, "kernel": 1.0, "attn": 0.5}
# bench/e2e.py run key -> (bundled config, --quantization)
MODELS = {"qwen2.5-7b-awq": ("qwen2.5-7b-instruct", None), "llama-3.1-8b-gptq": ("llama-3.1-8b-instruct", None),
          "qwen2.5-7b-gguf-q4_k_m": ("qwen2.5-7b-instruct", "gguf:Q4_K_M"),
          "qwen2.5-7b-gguf-q5_k_m": ("qwen2.5-7b-instruct", "gguf:Q5_K_M"),
          "qwen2.5-7b-gguf-q4_0": ("qwen2.5-7b-instruct", "gguf:Q4_0"),
          "qwen2.5-7b-gguf-q8_0": ("qwen2.5-7b-instruct", "gguf:Q8_0")}

# The committed runs each plan is fitted from: (file, GPU, profile, which entries; None: all). Kernel files at
# 19dfdc4 (H200), 1ad1e0b / d6f3e1c / a58e592 / b73e2ff (H100); e2e at 6938874 / 61c12a7 / ea9d457 (H200), 4ae45ab /
# 1ad1e0b / a58e592 (H100). kernels-gguf-h100.json (778d77c) is left out: its Q4_K ran a capped tile since replaced.
# The end-to-end runs fitted are Qwen2.5-7B AWQ's (plan --gpu's model), measured on both GPUs.
COMMITTED = {
    "sm90": [("kernels-h200.json", "h200", "this", None), ("kernels-gguf-q8-h100.json", "h100", "this", None),
             ("kernels-gguf-q4k-h100.json", "h100", "this", ("gguf-q4_k",)),
             ("kernels-gguf-q5k-frag-h100.json", "h100", "this", ("gguf-q5_k-frag",)),
             ("kernels-gguf-q6k-frag-h100.json", "h100", "this", None),
             ("e2e-qwen-fp8-h200.json", "h200", "this", None),
             ("e2e-gguf-before-probe-fix-h200.json", "h200", "this", ("qwen2.5-7b-awq",)),
             ("e2e-h200.json", "h200", "this", ("qwen2.5-7b-awq",)), ("e2e-gguf-h100.json", "h100", "this", ("awq",)),
             ("e2e-gguf-q5-h100.json", "h100", "this", ("awq",)), ("e2e-gguf-q8-h100.json", "h100", "this", ("awq",))],
    "sm86": [("kernels-sm86-profile-h200.json", "h200", "a10", None),
             ("e2e-sm86-profile-h200.json", "h200", "a10", None)],
}
# Runs the fit does not see, to check what it says of other models and formats: GGUF mixes (H100) and
# Llama-3.1-8B GPTQ (H200). e2e-gguf-q8-h100.json's Q8_0 batch 32 ran an older plan (dequantize + cuBLAS above 16
# rows): left out.
CHECKS = {
    "sm90": [("e2e-h200.json", "h200", "this", ("llama",)), ("e2e-gguf-h100.json", "h100", "this", ("gguf",)),
             ("e2e-gguf-q5-h100.json", "h100", "this", ("gguf",)),
             ("e2e-gguf-q8-h100.json", "h100", "this", ("q4_0", "q8_0/auto:batch1", "q8_0/fp8:batch1"))],
    "sm86": [],
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def shape_of(run_key: str, kv: str, int4_head: bool = False):
    config, quantization = MODELS[run_key]
    return model_shape(_config(config), quantization, 1 if kv.startswith("fp8") else 2, int4_head, run_key)


def format_matmul(fmt: str, name: str, k: int, n: int) -> Matmul:
    """A benchmarked layer of weight format `fmt` (bench/kernel_speed.py --weights names; "ours": AWQ g128)."""
    if fmt == "fp16":
        return Matmul(name, k, n, k * n * 2, "fp16")
    if fmt in ("ours", "awq-g128"):
        return Matmul(name, k, n, k * n // 2 + (k // 128) * n * 5 // 2, "int4")
    from gguf import GGMLQuantizationType as T
    from quant_serve.engine.card_step import _gguf_family
    from quant_serve.engine.gguf_plan import _layer_bytes
    qtype = {"gguf-q4_0": T.Q4_0, "gguf-q4_k": T.Q4_K, "gguf-q5_k-frag": T.Q5_K, "gguf-q6_k-frag": T.Q6_K,
             "q8_0": T.Q8_0}[fmt]
    return Matmul(name, k, n, _layer_bytes([(qtype, k, n)], 2), _gguf_family(qtype))


def _kernel_obs(d: dict, gpu: str, profile: str, src: str, formats) -> list[Observation]:
    out = []

    def add(fmt, name, m, kernel, us, weight=WEIGHTS["kernel"]):
        if fmt == "fp16" and name not in FP16_SHAPES:
            return
        k, n = SHAPES[name]
        ks = launches(format_matmul(fmt, name, k, n), m, "cublas" if fmt == "fp16" else kernel)
        out.append(Observation(f"{gpu}/{profile} {fmt} {name} M={m}", gpu, profile, tuple(ks), 0, us * 1e-6, src,
                               weight))
    for name, rows in d.get("linear", {}).items():                     # bench/kernel_speed.py (AWQ g128)
        for r in rows:
            add("fp16", name, r["m"], "", r["fp16_us"])
            add("ours", name, r["m"], r["ours_config"]["kernel"], r["ours_us"])
    for fmt, shapes in d.get("gguf", {}).items():                      # bench/gguf_kernel_speed.py
        if formats is not None and fmt not in formats:
            continue
        for name, rows in shapes.items():
            for r in rows:
                add(fmt, name, r["m"], r["kernel"], r["ours_us"])
                if fmt == next(iter(d["gguf"])):                       # each file's FP16 once
                    add("fp16", name, r["m"], "", r["fp16_us"])
    hq, hkv, dim = 28, 4, 128
    for r in d.get("decode", []):
        for kv, size in (("fp16", 2), ("fp8", 1)):
            nbytes = 2 * r["batch"] * r["ctx"] * hkv * dim * size + 4 * r["batch"] * hq * dim
            out.append(Observation(f"{gpu}/{profile} attention {kv} B={r['batch']} ctx={r['ctx']}", gpu, profile,
                                   (Kernel("attn", attention_family(size), nbytes, grid_sized=True),), 0,
                                   r[f"{kv}_us"] * 1e-6, src,
                                   WEIGHTS["attn"]))
    return out


def _decode_obs(label, gpu, profile, shape, batch, context, tok_s, src) -> Observation:
    caps = plan_caps(gpu, profile)
    return Observation(label, gpu, profile, tuple(decode_kernels(shape, caps, batch, context)), 1, batch / tok_s,
                       src, WEIGHTS["step"])


def _e2e_obs(d: dict, gpu: str, profile: str, src: str, keys) -> list[Observation]:
    out = []
    for key, run in d.get("runs", {}).items():
        name, kv = key.split("/")[0], key.split("/")[1]
        if "error" in run or key.endswith("serve-budget") or name not in MODELS:
            continue
        shape = shape_of(name, kv, key.endswith("int4-head"))
        for batch, field in ((1, "batch1_tok_s"), (32, "batch32_tok_s")):
            if run.get(field) and (keys is None or _match(keys, key, batch)):
                out.append(_decode_obs(f"{gpu}/{profile} {key} batch {batch}", gpu, profile, shape, batch,
                                       E2E_CONTEXT, run[field], src))
    return out


def _match(keys, key: str, batch: int) -> bool:
    """keys: substrings of run keys, optionally ":batch1" / ":batch32" to take one batch only."""
    for k in keys:
        part, _, only = k.partition(":")
        if part in key and (not only or only == f"batch{batch}"):
            return True
    return False


def committed_observations(plan: str, results: Path, table: dict = COMMITTED) -> list[Observation]:
    """The committed runs of kernel plan `plan` ("sm90", "sm86") from the bench/results folder `results` (table:
    COMMITTED, what the fit sees, or CHECKS)."""
    out = []
    for file, gpu, profile, keys in table[plan]:
        d = json.loads((results / file).read_text())
        commit = str(d.get("git_commit") or d.get("metadata", {}).get("commit", "?")).split()[0][:12]
        src = f"{file} ({commit})"
        out += _e2e_obs(d, gpu, profile, src, keys) if file.startswith("e2e") else \
            _kernel_obs(d, gpu, profile, src, keys)
    return balanced(out)


def balanced(obs: list[Observation]) -> list[Observation]:
    """Each GPU's batch-1 and batch-32 steps weigh the same in all, however many runs of each were committed (the
    H100 has five batch-32 runs, the H200 three)."""
    def group(o):
        return o.gpu, o.label.rsplit(" ", 2)[-2:] == ["batch", "1"]
    steps = [o for o in obs if o.kind == "step"]
    sizes = Counter(group(o) for o in steps)
    mean = len(steps) / max(1, len(sizes))
    return [replace(o, weight=o.weight * mean / sizes[group(o)]) if o.kind == "step" else o for o in obs]


FIT_MODELS = ("qwen2.5-7b-awq",)         # end-to-end runs the fit takes; the other models' check it


def card_observations(d: dict, src: str, fit: bool = True) -> list[Observation]:
    """bench/card_model.py's JSON (one GPU, one profile, one commit): the kernels and FIT_MODELS' end-to-end runs, or
    (fit False) the other models' end-to-end runs."""
    gpu, profile = d["gpu_key"], d["profile"]
    out = []
    if not fit:
        d = {**d, "matmuls": [], "attention": [], "e2e": [r for r in d["e2e"] if r["model"] not in FIT_MODELS]}
    else:
        d = {**d, "e2e": [r for r in d["e2e"] if r["model"] in FIT_MODELS]}
    for r in d["matmuls"]:
        if r["format"] == "fp16" and r["shape"] not in FP16_SHAPES:
            continue
        mm = format_matmul(r["format"], r["shape"], r["k"], r["n"])
        out.append(Observation(f"{gpu}/{profile} {r['format']} {r['shape']} M={r['m']}", gpu, profile,
                               tuple(launches(mm, r["m"], r["kernel"])), 0, r["us"] * 1e-6, src, WEIGHTS["kernel"]))
    for r in d["attention"]:
        out.append(Observation(f"{gpu}/{profile} attention B={r['batch']} ctx={r['context']}", gpu, profile,
                               (Kernel("attn", attention_family(r["kv_bytes"]), r["bytes"], grid_sized=True),), 0,
                               r["us"] * 1e-6, src,
                               WEIGHTS["attn"]))
    caps = plan_caps(gpu, profile)
    for r in d["e2e"]:
        shape = shape_of(r["model"], r["kv"])
        if r["kind"] == "decode":
            out.append(_decode_obs(f"{gpu}/{profile} {r['model']} batch {r['batch']}", gpu, profile, shape,
                                   r["batch"], r["context"], r["tok_s"], src))
        else:
            chunks = [prefill_kernels(shape, caps, min(r["chunk"], r["prompt"] - s), s)
                      for s in range(0, r["prompt"], r["chunk"])]
            out.append(Observation(f"{gpu}/{profile} {r['model']} prefill {r['prompt']}", gpu, profile,
                                   tuple(k for c in chunks for k in c), len(chunks), r["seconds"], src,
                                   WEIGHTS["step"]))
    return out
