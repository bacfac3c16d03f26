"""End-to-end speed on the GPU, in one run: batch-1 decode and throughput under a 24 GiB cap, for the dummy
INT4 Qwen2.5-7B (AWQ g128) and Llama-3.1-8B (GPTQ g128) configs, next to Hugging Face transformers bf16 generate;
the Qwen2.5-7B config also as a GGUF Q4_K_M (llama.cpp's type mix: Q4_K with Q6_K for the head and half the v /
down projections; issue 33's target: batch 1 within 10% of AWQ, 24 GiB throughput within 15%), Q5_K_M, Q4_0 (Q6_K
head) and Q8_0.

    python bench/e2e.py --out bench/results/e2e-h200.json [--quick] [--profile a10] [--only qwen]

--profile runs the engine under a GPU profile (kernels/gpu.py), e.g. the sm86 plan of an A10 on the H200.
"""
import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from quant_serve.engine.config import (OFFLINE_BATCHED_TOKENS, SERVE_BATCHED_TOKENS, CacheConfig, EngineConfig,
                                       SchedulerConfig)
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.load.loader import BUNDLED_CONFIGS
from quant_serve.kernels.gpu import PROFILE_NAMES, KernelOptions
from quant_serve.server.cli.bench_offline import decode_bytes_per_step, measure_copy_bandwidth, run_offline
from quant_serve.server.cli.bench import _metadata

KERNELS = [KernelOptions()]    # --profile / --no-fold-norms: the kernel options every engine of this run takes

QWEN, LLAMA = BUNDLED_CONFIGS / "qwen2.5-7b-instruct", BUNDLED_CONFIGS / "llama-3.1-8b-instruct"
CONFIGS = {"qwen2.5-7b-awq": QWEN, "llama-3.1-8b-gptq": LLAMA, "qwen2.5-7b-gguf-q4_k_m": QWEN,
           "qwen2.5-7b-gguf-q5_k_m": QWEN, "qwen2.5-7b-gguf-q4_0": QWEN, "qwen2.5-7b-gguf-q8_0": QWEN}
# --quantization of the dummy load; else the config's
QUANTIZATION = {"qwen2.5-7b-gguf-q4_k_m": "gguf:Q4_K_M", "qwen2.5-7b-gguf-q5_k_m": "gguf:Q5_K_M",
                "qwen2.5-7b-gguf-q4_0": "gguf:Q4_0", "qwen2.5-7b-gguf-q8_0": "gguf:Q8_0"}
TOKENIZER = Path(__file__).resolve().parents[1] / "engine" / "load" / "demo_model"   # any tokenizer: prompts are random ids


def engine_for(config_dir: Path, kv: str, max_num_seqs: int, max_model_len: int, enforce_eager: bool,
               batched_tokens: int = OFFLINE_BATCHED_TOKENS, int4_head: bool = False,
               quantization: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(config_dir), tokenizer=str(TOKENIZER), load_format="dummy", max_model_len=max_model_len,
        quantization=quantization,
        enforce_eager=enforce_eager, quantize_lm_head=int4_head,
        cache=CacheConfig(kv_cache_dtype=kv, gpu_memory_gb=24.0, gpu_memory_utilization=0.90),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched_tokens),
        kernels=KERNELS[0]), show_progress=False)


def hf_generate(config_dir: Path, batch: int, prompt_len: int = 128, new_tokens: int = 128) -> float:
    """transformers bf16 generate with random weights: output tok/s (the anchor in targets.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(str(config_dir))
    cfg.quantization_config = None
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt_len), device="cuda")
    kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    tok_s = batch * new_tokens / (time.perf_counter() - start)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return tok_s


def measure(name: str, config_dir: Path, kv: str, n_conc: int, bandwidth: float, enforce_eager: bool,
            batched_tokens: int = OFFLINE_BATCHED_TOKENS, batch1: bool = True, int4_head: bool = False) -> dict:
    start = time.perf_counter()
    engine = engine_for(config_dir, kv, max_num_seqs=256, max_model_len=4096, enforce_eager=enforce_eager,
                        batched_tokens=batched_tokens, int4_head=int4_head, quantization=QUANTIZATION.get(name))
    torch.cuda.reset_peak_memory_stats()
    run = {"startup_s": time.perf_counter() - start,
           "kv_cache_tokens": engine.block_manager.num_blocks * engine.config.cache.block_size,
           "planned_kv_bytes": engine.memory_plan.kv_cache_bytes if engine.memory_plan else None,
           "allocated_kv_bytes": sum(t.numel() * t.element_size()
                                     for t in engine.runner.k_caches + engine.runner.v_caches),
           "decode_bytes_per_step": decode_bytes_per_step(engine.model), "max_num_batched_tokens": batched_tokens}
    if batch1:
        b1 = run_offline(engine, 1, 128, 256)
        run["batch1"] = b1
        run["batch1_tok_s"] = b1["decode_tok_s"]
        run["roofline_tok_s"] = bandwidth / run["decode_bytes_per_step"]
        run["roofline_fraction"] = b1["decode_tok_s"] / run["roofline_tok_s"]
        b32 = run_offline(engine, 32, 128, 256)        # 32 chats at once: the batch plan --gpu projects too
        run["batch32"] = b32
        run["batch32_tok_s"] = 32 / b32["tpot_p50_s"]
        print(f"{name} kv={kv}: batch-1 {b1['decode_tok_s']:.1f} tok/s ({run['roofline_fraction']:.0%} of "
              f"roofline), batch-32 {run['batch32_tok_s']:.0f} tok/s, KV {run['kv_cache_tokens']} tokens", flush=True)
    if kv != "auto":        # the 24 GiB throughput run: fp8 (the serving default), int4 / int8 beside it
        thr = run_offline(engine, n_conc, 512, 256)
        run["throughput"] = thr
        print(f"{name} kv={kv} budget={batched_tokens}: {n_conc} x 512/256 -> {thr['output_tok_s']:.0f} out tok/s, "
              f"TTFT p50 {thr['ttft_p50_s']:.2f}s p99 {thr['ttft_p99_s']:.2f}s, "
              f"TPOT p50 {thr['tpot_p50_s'] * 1e3:.1f}ms", flush=True)
    run["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    run["gpu_memory_reserved_bytes"] = torch.cuda.memory_reserved()
    del engine
    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/e2e-h200.json")
    parser.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", default="this", choices=PROFILE_NAMES, help="GPU profile (kernels/gpu.py)")
    parser.add_argument("--fold-norms", default=True, action=argparse.BooleanOptionalAction,
                        help="batch 1: RMSNorms folded into the matmuls (KernelOptions.fold_norms)")
    parser.add_argument("--only", default="", help="run only the runs whose key contains one of these (comma-separated)")
    parser.add_argument("--skip", default="", help="skip the runs whose key contains one of these (comma-separated)")
    parser.add_argument("--kv", default="auto,fp8",
                        help="KV cache dtypes of each model's runs (comma-separated; e.g. auto,fp8,int4: int4 / int8 "
                             "get the throughput run as fp8 does, in the same process)")
    args = parser.parse_args()
    KERNELS[0] = KernelOptions(profile=args.profile, fold_norms=args.fold_norms)
    n_conc = 32 if args.quick else 256
    result = {"metadata": _metadata(args), "runs": {}}
    bandwidth = measure_copy_bandwidth()
    result["copy_bandwidth_bytes_s"] = bandwidth
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    # (run key, model, kv, token budget, batch-1 too): throughput at the offline budget (vLLM's LLM class default on
    # cards under 70 GiB) and, for comparison, at the serving budget
    plan = [(f"{name}/{kv}", name, kv, OFFLINE_BATCHED_TOKENS, True, False) for name in CONFIGS
            for kv in args.kv.split(",")]
    plan += [(f"{name}/fp8/serve-budget", name, "fp8", SERVE_BATCHED_TOKENS, False, False) for name in CONFIGS]
    # batch-1 with --quantize-lm-head: the FP16 head (1.09 GB a step) as an INT4 g128 copy
    plan.append(("qwen2.5-7b-awq/auto/int4-head", "qwen2.5-7b-awq", "auto", OFFLINE_BATCHED_TOKENS, True, True))
    only, skip = [o for o in args.only.split(",") if o], [o for o in args.skip.split(",") if o]
    plan = [p for p in plan if (not only or any(o in p[0] for o in only)) and not any(o in p[0] for o in skip)]
    for key, name, kv, budget, batch1, int4_head in plan:
        try:
            result["runs"][key] = measure(name, CONFIGS[name], kv, n_conc, bandwidth, args.enforce_eager, budget,
                                          batch1, int4_head)
        except Exception as e:  # keep what the other runs measured
            traceback.print_exc()
            result["runs"][key] = {"error": repr(e)}
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.skip_hf:
        try:
            result["hf_batch1_tok_s"] = hf_generate(CONFIGS["qwen2.5-7b-awq"], 1)
            result["hf_batch64_tok_s"] = hf_generate(CONFIGS["qwen2.5-7b-awq"], 64)
            print(f"HF bf16: batch 1 {result['hf_batch1_tok_s']:.1f}, batch 64 {result['hf_batch64_tok_s']:.0f} tok/s")
        except Exception as e:
            traceback.print_exc()
            result["hf_error"] = repr(e)
    runs = result["runs"]
    q16, q8 = runs.get("qwen2.5-7b-awq/auto", {}), runs.get("qwen2.5-7b-awq/fp8", {})
    thr = q8.get("throughput", {})
    result["summary"] = {
        "batch1_tok_s": q16.get("batch1_tok_s"), "batch1_fp8_tok_s": q8.get("batch1_tok_s"),
        "batch32_tok_s": q16.get("batch32_tok_s"), "batch32_fp8_tok_s": q8.get("batch32_tok_s"),
        "roofline_fraction": q16.get("roofline_fraction"), "throughput_tok_s": thr.get("output_tok_s"),
        "ttft_p50_s": thr.get("ttft_p50_s"), "ttft_p99_s": thr.get("ttft_p99_s"),
        "tpot_p50_s": thr.get("tpot_p50_s"), "tpot_p99_s": thr.get("tpot_p99_s"),
        "llama_batch1_tok_s": runs.get("llama-3.1-8b-gptq/auto", {}).get("batch1_tok_s"),
        "batch1_int4_head_tok_s": runs.get("qwen2.5-7b-awq/auto/int4-head", {}).get("batch1_tok_s"),
        "llama_throughput_tok_s": runs.get("llama-3.1-8b-gptq/fp8", {}).get("throughput", {}).get("output_tok_s"),
        "kv_cache_tokens_fp8_24gib": q8.get("kv_cache_tokens"), "max_num_batched_tokens": OFFLINE_BATCHED_TOKENS,
        "throughput_serve_budget_tok_s": runs.get("qwen2.5-7b-awq/fp8/serve-budget", {}).get("throughput", {}).get(
            "output_tok_s"),
        "hf_batch1_tok_s": result.get("hf_batch1_tok_s"), "hf_batch64_tok_s": result.get("hf_batch64_tok_s"),
        "concurrency": n_conc, "profile": args.profile}
    g16, g8 = runs.get("qwen2.5-7b-gguf-q4_k_m/auto", {}), runs.get("qwen2.5-7b-gguf-q4_k_m/fp8", {})
    g_thr = g8.get("throughput", {}).get("output_tok_s")
    result["summary"] |= {
        "gguf_q4_k_m_batch1_tok_s": g16.get("batch1_tok_s"), "gguf_q4_k_m_throughput_tok_s": g_thr,
        "gguf_vs_awq_batch1": (g16["batch1_tok_s"] / q16["batch1_tok_s"]
                               if g16.get("batch1_tok_s") and q16.get("batch1_tok_s") else None),
        "gguf_vs_awq_throughput": (g_thr / thr["output_tok_s"] if g_thr and thr.get("output_tok_s") else None),
        "gguf_q5_k_m_batch1_tok_s": runs.get("qwen2.5-7b-gguf-q5_k_m/auto", {}).get("batch1_tok_s"),
        "gguf_q4_0_batch1_tok_s": runs.get("qwen2.5-7b-gguf-q4_0/auto", {}).get("batch1_tok_s"),
        "gguf_q8_0_batch1_tok_s": runs.get("qwen2.5-7b-gguf-q8_0/auto", {}).get("batch1_tok_s")}
    for kv in ("int8", "int4"):     # issue 56: the int cache beside fp8, same model, same run
        qi = runs.get(f"qwen2.5-7b-awq/{kv}", {})
        i_thr = qi.get("throughput", {}).get("output_tok_s")
        if qi:
            result["summary"] |= {
                f"kv_{kv}_batch1_tok_s": qi.get("batch1_tok_s"), f"kv_{kv}_throughput_tok_s": i_thr,
                f"kv_cache_tokens_{kv}_24gib": qi.get("kv_cache_tokens"),
                f"kv_{kv}_over_fp8_throughput": (i_thr / thr["output_tok_s"]
                                                 if i_thr and thr.get("output_tok_s") else None)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
