"""Shared test helpers: building engines on the fixture and checking that no KV block leaked."""
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine


def make_engine(model, *, num_blocks=256, chunk=2048, prefix_caching=True, max_num_seqs=64, dtype="float32",
                kv_cache_dtype="auto", max_model_len=None, num_cpu_blocks=None, kv_scale_source="auto",
                device="cpu", **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(model), dtype=dtype, device=device, max_model_len=max_model_len,
        cache=CacheConfig(num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype, num_cpu_blocks=num_cpu_blocks,
                          kv_scale_source=kv_scale_source),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk), **kw)
    return LLMEngine(config, show_progress=False)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks, \
        f"{bm.num_cpu_blocks - bm.num_free_cpu_blocks} CPU-tier KV blocks leaked"
    assert all(b.ref_cnt == 0 for b in bm.gpu.blocks) and (bm.cpu is None or all(b.ref_cnt == 0 for b in bm.cpu.blocks))
    assert bm.take_swaps() == ([], []) and bm.pending_copies == []
    assert not engine.scheduler.has_unfinished()
