"""Shared test helpers: building engines, checking that no KV block leaked, loading bench scripts."""
import importlib.util
from pathlib import Path

from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.kernels.gpu import KernelOptions

from conftest import GPU_PROFILE, REPO, TINY_AWQ, has_weights


def make_engine(model, *, num_blocks=256, chunk=2048, prefix_caching=True, max_num_seqs=64, dtype="float32",
                kv_cache_dtype="auto", max_model_len=None, num_cpu_blocks=None, kv_scale_source="auto",
                device="cpu", kv_exact_tokens=None, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(model), dtype=dtype, device=device, max_model_len=max_model_len,
        cache=CacheConfig(num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype, num_cpu_blocks=num_cpu_blocks,
                          kv_scale_source=kv_scale_source, kv_exact_tokens=kv_exact_tokens),
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


def awq_model_dir() -> Path:
    """AutoAWQ's tiny-qwen2 checkpoint, or the bundled demo model (our AWQ of the same model) where the fixture
    did not travel (the GPU machine gets only what fits in the working tree)."""
    return TINY_AWQ if has_weights(TINY_AWQ) else DEMO_MODEL_DIR


def bench_script(name: str):
    """bench/NAME.py loaded by path (bench/ is not a package the product imports)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
