"""Shared test helpers: building engines on the fixture, checking that no KV block leaked, and the fixture
models the GPU tests run on."""
import importlib.util
import json
import shutil
from pathlib import Path

from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.kernels.gpu import KernelOptions

from conftest import GPU_PROFILE, REPO, TINY, TINY_AWQ


def make_engine(model, *, num_blocks=256, chunk=2048, prefix_caching=True, max_num_seqs=64, dtype="float32",
                kv_cache_dtype="auto", max_model_len=None, num_cpu_blocks=None, kv_scale_source="auto",
                device="cpu", **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(model), dtype=dtype, device=device, max_model_len=max_model_len,
        cache=CacheConfig(num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype, num_cpu_blocks=num_cpu_blocks,
                          kv_scale_source=kv_scale_source),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk),
        **{"kernels": KernelOptions(profile=GPU_PROFILE[0]), **kw})
    return LLMEngine(config, show_progress=False)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, \
        f"{bm.num_cpu_blocks - bm.num_free_cpu_blocks} CPU-tier KV blocks leaked"
    assert all(b.ref_cnt == 0 for b in bm.gpu.blocks) and (bm.cpu is None or all(b.ref_cnt == 0 for b in bm.cpu.blocks))
    assert bm.take_swaps() == ([], []) and bm.pending_copies == []
    assert not engine.scheduler.has_unfinished()


def _has_weights(model_dir: Path) -> bool:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return all((model_dir / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return (model_dir / "model.safetensors").is_file()


def awq_model_dir() -> Path:
    """AutoAWQ's tiny-qwen2 checkpoint, or the bundled demo model (our AWQ of the same model) where the fixture
    did not travel (the GPU machine gets only what fits in the working tree)."""
    return TINY_AWQ if _has_weights(TINY_AWQ) else DEMO_MODEL_DIR


def bench_script(name: str):
    """bench/NAME.py loaded by path (bench/ is not a package the product imports)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fp16_model_dir(tmp_root: Path) -> Path:
    """tiny-qwen2 in FP16, or where its 53 MB of weights did not travel, the bundled demo model dequantized by our
    readers and saved as an FP16 checkpoint (a trained model too, so greedy comparisons stay meaningful)."""
    if _has_weights(TINY):
        return TINY
    out = Path(tmp_root) / "demo-dequantized-fp16"
    if not (out / "model.safetensors").is_file():
        from safetensors.torch import save_file
        weights = bench_script("quant_quality").dense_weights(DEMO_MODEL_DIR)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.half().contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
        config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
        config.pop("quantization_config", None)
        config["torch_dtype"] = "float16"
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for f in DEMO_MODEL_DIR.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                shutil.copy(f, out / f.name)
    return out
