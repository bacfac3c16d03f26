"""How many KV blocks the engine allocates: on the GPU (an exact count, the memory plan on CUDA, or a fixed pool
size) and in the CPU tier."""
import logging

import torch

from quant_serve.engine.config import EngineConfig, ModelConfig
from quant_serve.engine.load.loader import resolve_model_dir
from quant_serve.engine.lora.manager import slot_bytes
from quant_serve.engine.plan.memory import MemoryPlan, kv_head_token_bytes, plan_memory
from quant_serve.kernels.attention.kv_exact import alloc_rings
from quant_serve.kernels.attention.kv_int import IntKVFormat, alloc_int_cache, hadamard

logger = logging.getLogger("quant_serve")


def _bytes_per_block(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    cache, cfg = config.cache, model_config
    kv_bytes = kv_head_token_bytes(cache.kv_cache_dtype, dtype, cfg.head_dim, cache.kv_group_size,
                                   cache.kv_zero_point)
    return 2 * cfg.num_layers * cache.block_size * cfg.num_kv_heads * kv_bytes


def _draft_model(config: EngineConfig) -> str | None:
    spec = config.speculative
    return spec.model if spec.enabled and spec.method == "draft_model" else None


def verify_rows(config: EngineConfig) -> int:
    """Token rows of the largest verification graph (engine/spec/graphs.py): the batch speculation runs up to
    times k + 1; 0 without speculation."""
    spec = config.speculative
    if not spec.enabled:
        return 0
    return min(spec.disable_by_batch_size, config.scheduler.max_num_seqs) * (spec.num_speculative_tokens + 1)


def _draft_bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    """The draft model's KV per block (its cache holds as many blocks as the target's, in the model dtype)."""
    if _draft_model(config) is None:
        return 0
    from quant_serve.engine.load.loader import load_model_config
    cfg, _ = load_model_config(resolve_model_dir(_draft_model(config)))
    return 2 * cfg.num_layers * config.cache.block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def num_gpu_blocks(config: EngineConfig, model_config: ModelConfig, model_dir, device: str, dtype: torch.dtype,
                   max_model_len: int) -> tuple[int, MemoryPlan | None, int]:
    """(blocks, the memory plan when one was made, max_model_len). Exact count when given; on CUDA the memory plan
    (same function as `quant-serve plan`); else a pool of kv_cache_memory_gb (1 GiB by default). On the CPU path a
    max_model_len the user did not ask for (the model's full context) is lowered to what the pool holds, as vLLM
    does when --max-model-len is not given; an explicit one that does not fit stays an error."""
    cache = config.cache
    plan = None
    if cache.num_gpu_blocks is not None:
        num_blocks = cache.num_gpu_blocks
    elif device != "cpu" and cache.kv_cache_memory_gb is None:
        plan = _plan(config, model_dir, device, dtype, max_model_len, model_config)
        num_blocks = plan.num_blocks
    else:
        num_blocks = int((cache.kv_cache_memory_gb or 1.0) * 2**30) // (
            _bytes_per_block(config, model_config, dtype) + _draft_bytes_per_block(config, dtype))
    fit = num_blocks * cache.block_size
    if fit < max_model_len and device == "cpu" and config.max_model_len is None and fit > 0:
        logger.warning("max_model_len lowered from the model's %d to %d tokens, all that the KV cache (%d blocks) "
                       "holds; give it more memory (--kv-cache-memory-gb) for a longer context", max_model_len, fit,
                       num_blocks)
        return num_blocks, plan, fit
    if fit < max_model_len:
        raise ValueError(f"KV cache holds {fit} tokens ({num_blocks} blocks), fewer than one sequence at "
                         f"max_model_len {max_model_len}; lower --max-model-len to at most {fit} or "
                         "give the cache more memory")
    return num_blocks, plan, max_model_len


def num_cpu_blocks(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    if config.cache.num_cpu_blocks is not None:
        return config.cache.num_cpu_blocks
    return int(config.cache.cpu_kv_gb * 2**30) // _bytes_per_block(config, model_config, dtype)


def _plan(config: EngineConfig, model_dir, device: str, dtype: torch.dtype, max_model_len: int,
          model_config: ModelConfig) -> MemoryPlan:
    cache, sched = config.cache, config.scheduler
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total_gb = torch.cuda.get_device_properties(index).total_memory / 2**30
    gpu_gb = cache.gpu_memory_gb or total_gb
    if cache.gpu_memory_gb is not None:  # emulate a smaller card: the allocator must not go past it either
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_gb / total_gb), index)
    plan = plan_memory(model_dir, gpu_mem_gb=gpu_gb, gpu_memory_utilization=cache.gpu_memory_utilization,
                       kv_cache_dtype=cache.kv_cache_dtype, max_model_len=max_model_len,
                       max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
                       block_size=cache.block_size, enforce_eager=config.enforce_eager,
                       weights_dtype=str(dtype).replace("torch.", ""), int4_head=config.quantize_lm_head,
                       quantization=config.quantization, verify_rows=verify_rows(config),
                       draft_model=None if _draft_model(config) is None else
                       resolve_model_dir(_draft_model(config)),
                       lora_bytes=slot_bytes(model_config, config.lora, dtype) if config.lora.enable_lora else 0,
                       kv_exact_tokens=cache.kv_exact_tokens, kv_group_size=cache.kv_group_size,
                       kv_zero_point=cache.kv_zero_point)
    if not plan.fits:
        raise ValueError(plan.error_message())
    return plan


def allocate_kv_cache(layers, shape: tuple[int, int, int, int], dtype: torch.dtype, fmt: IntKVFormat | None,
                      device, rings: tuple[int, int, torch.dtype] | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Each attention layer's K and V caches [num_blocks, block_size, Hkv, D] -> (k caches, v caches, scales).
    An integer cache (fmt) also gets per-block scales tensors, indexed by the same block ids, which take the place
    of the layer's fp8 k_scale / v_scale, with fmt.rotate the layer's Hadamard matrix, and with rings = (rows,
    tokens, dtype) its exact window's rings (kernels/attention/kv_exact.py)."""
    k_caches, v_caches, scales = [], [], []
    for attn in layers:
        if fmt is not None:
            attn.k_cache, attn.k_scale = alloc_int_cache(fmt, *shape, device)
            attn.v_cache, attn.v_scale = alloc_int_cache(fmt, *shape, device)
            scales += [attn.k_scale, attn.v_scale]
            if fmt.rotate:
                attn.kv_rotation = hadamard(shape[-1], device)
            if rings is not None:
                attn.kv_rings = alloc_rings(rings[0], rings[1], shape[2], shape[3], rings[2], device)
        else:
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        k_caches.append(attn.k_cache)
        v_caches.append(attn.v_cache)
    return k_caches, v_caches, scales
