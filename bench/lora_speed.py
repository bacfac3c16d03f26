"""LoRA serving speed (issue 55): decode with adapters against the same base without, in one process.

Random rank-R adapters on all seven projections (q, k, v, o, gate, up, down), written as PEFT saves them, over the
dummy INT4 Qwen2.5-7B (AWQ g128) under a 24 GiB cap. Runs, each 128 in / 256 out, greedy:
  - an engine without --enable-lora: batch 1 and 32 concurrent (the baseline);
  - an engine with --enable-lora --max-loras N: batch 1 on the base, batch 1 on an adapter, 32 on the base and 32
    spread round-robin over the N adapters.
Goals: batch 1 with an adapter >= 0.90x without; 32 over 8 adapters >= 0.85x the 32 without.

    python bench/lora_speed.py --out bench/results/lora-speed-h100.json [--profile a10] [--smoke]

--smoke: the shared tiny model (or --model DIR) on the CPU, few tokens: checks the script, measures nothing.
"""
import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant_serve.engine.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.load.loader import BUNDLED_CONFIGS
from quant_serve.kernels.gpu import PROFILE_NAMES, KernelOptions
from quant_serve.server.cli.bench import _metadata
from quant_serve.server.cli.bench_offline import run_offline

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "engine" / "load" / "demo_model"      # prompts are random ids: any tokenizer of the vocab size
SMOKE_MODEL = REPO.parent / "shared" / "models" / "tiny-qwen2"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of a Llama / Qwen2 decoder layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapter(path: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) with random A / B on every projection
    of every layer. B is not zero (PEFT's init), so the adapter changes the output and its work is not skipped."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (k, n) in projection_shapes(config).items():
            parent = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, k, generator=g) * k ** -0.5).half()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n, rank, generator=g) * 0.01).half()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
        "bias": "none", "use_rslora": False}))


def make_engine(model: Path, tokenizer: Path, dummy: bool, kv: str, kernels: KernelOptions,
                lora: LoRAConfig | None) -> LLMEngine:
    cuda = torch.cuda.is_available()
    return LLMEngine(EngineConfig(
        model=str(model), tokenizer=str(tokenizer), load_format="dummy" if dummy else "auto", max_model_len=2048,
        device="cuda" if cuda else "cpu",
        cache=CacheConfig(kv_cache_dtype=kv, gpu_memory_gb=24.0 if cuda else None, gpu_memory_utilization=0.90),
        scheduler=SchedulerConfig(max_num_seqs=64), kernels=kernels, lora=lora or LoRAConfig()),
        show_progress=False)


def timed(engine: LLMEngine, batch: int, in_len: int, out_len: int, lora_names: list | None) -> dict:
    run = run_offline(engine, batch, in_len, out_len, lora_names=lora_names)
    run["tok_s"] = run["decode_tok_s"] if batch == 1 else run["output_tok_s"]
    return run


def release() -> None:
    """After the caller dropped its engine: the next one starts from an empty 24 GiB cap."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/lora-speed.json")
    p.add_argument("--model", default=None, help="config dir (default: the bundled Qwen2.5-7B config, dummy weights)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kv", default="fp8")
    p.add_argument("--profile", default="this", choices=PROFILE_NAMES)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        model, tokenizer, dummy = Path(args.model or SMOKE_MODEL), Path(args.model or SMOKE_MODEL), False
        in_len, out_len, kv = 16, 8, "auto"
    else:
        model, tokenizer, dummy = Path(args.model or BUNDLED_CONFIGS / "qwen2.5-7b-instruct"), TOKENIZER, True
        in_len, out_len, kv = 128, 256, args.kv
    config = json.loads((model / "config.json").read_text())
    kernels = KernelOptions(profile=args.profile)
    result = {"metadata": _metadata(args), "model": str(model), "rank": args.rank, "adapters": args.adapters,
              "batch": args.batch, "input_len": in_len, "output_len": out_len, "kv_cache_dtype": kv,
              "profile": args.profile, "runs": {}}
    runs = result["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        names = {f"adapter{i}": str(Path(tmp) / f"adapter{i}") for i in range(args.adapters)}
        for i, path in enumerate(names.values()):
            write_random_adapter(Path(path), config, args.rank, seed=i)
        print(f"{args.adapters} rank-{args.rank} adapters written in {time.perf_counter() - start:.0f} s", flush=True)

        engine = make_engine(model, tokenizer, dummy, kv, kernels, None)
        runs["no_lora/batch1"] = timed(engine, 1, in_len, out_len, None)
        runs[f"no_lora/batch{args.batch}"] = timed(engine, args.batch, in_len, out_len, None)
        del engine
        release()

        lora = LoRAConfig(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, lora_modules=names)
        engine = make_engine(model, tokenizer, dummy, kv, kernels, lora)
        adapters = list(names)
        runs["lora/batch1/base"] = timed(engine, 1, in_len, out_len, None)
        runs["lora/batch1/adapter"] = timed(engine, 1, in_len, out_len, adapters[:1])
        runs[f"lora/batch{args.batch}/base"] = timed(engine, args.batch, in_len, out_len, None)
        runs[f"lora/batch{args.batch}/{args.adapters}-adapters"] = timed(engine, args.batch, in_len, out_len,
                                                                         adapters)
        result["slot_loads"] = engine.lora.num_slot_loads
        del engine
        release()
    tok = {k: v["tok_s"] for k, v in runs.items()}
    b = args.batch
    result["summary"] = {
        **{f"{k}_tok_s": v for k, v in tok.items()},
        "batch1_adapter_over_no_lora": tok["lora/batch1/adapter"] / tok["no_lora/batch1"],
        "batch1_adapter_over_lora_base": tok["lora/batch1/adapter"] / tok["lora/batch1/base"],
        f"batch{b}_adapters_over_no_lora": tok[f"lora/batch{b}/{args.adapters}-adapters"] / tok[f"no_lora/batch{b}"],
        f"batch{b}_adapters_over_lora_base":
            tok[f"lora/batch{b}/{args.adapters}-adapters"] / tok[f"lora/batch{b}/base"],
        "goals": {"batch1": 0.90, f"batch{b}": 0.85}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
