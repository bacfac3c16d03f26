"""Start-up time of the serving engine on the GPU: a fresh start (empty Triton cache) and a restart (the cache the
fresh start left), for the dummy INT4 Qwen2.5-7B config under a 24 GiB cap with `quant-serve serve`'s defaults
(token budget 2048, 256 sequences, fp8 KV). Each start is its own process; the time is from the process start to
an engine ready to serve (weights loaded, kernels compiled, decode graphs captured, warm-up forwards run).

    python bench/cold_start.py --out bench/results/cold-start-h200.json [--workers 16,1] [--profile a10]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "engine" / "load" / "configs" / "qwen2.5-7b-instruct"   # shipped, no weights
TOKENIZER = Path(__file__).resolve().parents[1] / "engine" / "load" / "demo_model"   # any tokenizer: prompts are random ids

CHILD = """
import cProfile, io, json, logging, pstats, sys, time
start = float(sys.argv[1])
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(relativeCreated)8.0f ms %(message)s")
from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SERVE_BATCHED_TOKENS
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.kernels.gpu import KernelOptions
imported = time.time()
config = EngineConfig(
    model=sys.argv[2], tokenizer=sys.argv[3], load_format="dummy", max_model_len=4096,
    cache=CacheConfig(kv_cache_dtype="fp8", gpu_memory_gb=24.0),
    scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=SERVE_BATCHED_TOKENS),
    kernels=KernelOptions(profile=sys.argv[4], compile_workers=int(sys.argv[5])))
profiler = cProfile.Profile() if sys.argv[6] == "1" else None
if profiler:
    profiler.enable()
engine = LLMEngine(config, show_progress=False)
ready = time.time()
out = {"import_s": imported - start, "engine_s": ready - imported, "total_s": ready - start,
       "decode_graphs": len(engine.runner.decode_graphs.graphs) if engine.runner.decode_graphs else 0}
if profiler:
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    out["profile_top40_cumulative"] = text.getvalue().splitlines()[-48:]
print(json.dumps(out))
"""


def start_once(cache_dir: str, profile: str, workers: int, cprofile: bool = False) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, TRITON_INTERPRET="0")
    t0 = time.time()
    run = subprocess.run([sys.executable, "-c", CHILD, str(t0), str(CONFIG), str(TOKENIZER), profile, str(workers),
                          "1" if cprofile else "0"], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        return {"error": run.stderr[-3000:]}
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["log"] = [line for line in run.stderr.splitlines() if " ms " in line[:12]][-30:]
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cold-start-h200.json")
    ap.add_argument("--workers", default="16,1", help="compile threads to compare (first: the default)")
    ap.add_argument("--profile", default="this")
    ap.add_argument("--cprofile-restart", action="store_true", help="also a third start under cProfile (its top 40)")
    args = ap.parse_args()
    import torch
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"command": " ".join(sys.argv), "commit": commit or None, "gpu": torch.cuda.get_device_name(),
           "profile": args.profile, "config": "qwen2.5-7b-instruct, dummy INT4 (AWQ g128), fp8 KV, 24 GiB cap",
           "runs": {}}
    for workers in (int(w) for w in args.workers.split(",")):
        with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
            out["runs"][f"fresh/{workers}-threads"] = start_once(cache, args.profile, workers)
            out["runs"][f"restart/{workers}-threads"] = start_once(cache, args.profile, workers)
            if args.cprofile_restart:
                out["runs"][f"restart-cprofile/{workers}-threads"] = start_once(cache, args.profile, workers, True)
        for key in (f"fresh/{workers}-threads", f"restart/{workers}-threads"):
            run = out["runs"][key]
            print(f"{key}: {run.get('total_s', float('nan')):.1f} s to ready "
                  f"(import {run.get('import_s', float('nan')):.1f} s)", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
