"""Which side of the int4 KV cache costs the accuracy (issue #56): the demo model with an fp16 cache into which only
K, or only V, is written quantized and dequantized again (the default int4 format: groups of 16, zero points,
Hadamard-rotated; kernels/attention/kv_int.py), against the plain fp16 cache, as bench/kv_quant_accuracy.py
measures (heldout.txt, 512-token windows, CPU path).

    python bench/kv_quant_side.py [--out bench/results/kv-quant-side-demo-cpu.json]
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.worker import attention
from quant_serve.eval.compare import ReferenceStore
from quant_serve.eval.data import load_tokens, make_windows
from quant_serve.kernels.attention.kv_int import dequantize_int, hadamard, int_kv_format, quantize_int
from quant_serve.kernels.attention.paged import store_kv

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from kv_quant_accuracy import git_commit  # noqa: E402


def engine() -> LLMEngine:
    cache = CacheConfig(num_gpu_blocks=256, enable_prefix_caching=False)
    return LLMEngine(EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float16", cache=cache,
                                  scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024,
                                                            max_num_batched_tokens=2048)), show_progress=False)


def fake_quant_store(side: str, head_dim: int):
    """A stand-in for attention.rope_store_kv that stores `side` (k or v) as the int4 cache would read it back."""
    fmt = int_kv_format("int4", head_dim)
    h = hadamard(head_dim)

    def fq(x):
        return (dequantize_int(*quantize_int(x.float() @ h, fmt)) @ h).to(x.dtype)

    def rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slots, k_scale, v_scale):
        q.copy_(attention.apply_rope_ref(q, positions, cos_sin))
        k.copy_(attention.apply_rope_ref(k, positions, cos_sin))
        store_kv(fq(k) if side == "k" else k, fq(v) if side == "v" else v, k_cache, v_cache, slots, k_scale, v_scale)
    return rope_store, fmt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "bench/results/kv-quant-side-demo-cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.time()
    ref = engine()
    ids = load_tokens([str(REPO / "tests/data/heldout.txt")], ref.tokenizer, 32768)
    windows = make_windows(ids, 512, 512)
    rows, original = [], attention.rope_store_kv
    with ReferenceStore(windows, ref.model_config.vocab_size) as store:
        ref_stats = store.fill(ref, "fp16 cache").summary()
        for side in ("k", "v"):
            attention.rope_store_kv, fmt = fake_quant_store(side, ref.model_config.head_dim)
            try:
                s = store.compare(engine(), f"{side} only").summary()
            finally:
                attention.rope_store_kv = original
            rows.append({"quantized": side, "format": str(fmt), "perplexity": s["perplexity"],
                         "ppl_delta_pct": 100 * (s["perplexity"] / ref_stats["perplexity"] - 1), "kld": s["kld"],
                         "top1": s["top1"]})
            print(rows[-1], flush=True)
    result = {"command": "python bench/kv_quant_side.py " + " ".join(argv or sys.argv[1:]), "commit": git_commit(),
              "hardware": f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "model": "engine/load/demo_model (float16)", "reference": {"kv_cache_dtype": "float16", **ref_stats},
              "rows": rows, "seconds": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
