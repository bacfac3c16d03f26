"""KV-scale calibration: run calibration text through the model over a temporary cache and return the
kv_scales.json content (engine/worker/kv_scales.py reads, writes and applies the scales)."""
import logging

from quant_serve.engine.core.block_manager import BlockManager
from quant_serve.engine.config import CacheConfig
from quant_serve.engine.worker.kv_scales import E4M3_MAX, KV_SCALE_MARGIN, KVRangeObserver, make_kv_scales
from quant_serve.engine.worker.model_runner import ModelRunner
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from quant_serve.engine.core.sequence import Sequence

logger = logging.getLogger("quant_serve")


def calibrate_kv_scales(engine_or_model, token_id_batches, dtype_max: float = E4M3_MAX,
                        margin: float = KV_SCALE_MARGIN, chunk: int = 2048) -> dict:
    """Run the calibration text through the model and return the kv_scales.json content (see the module doc).

    engine_or_model: an LLMEngine (call it while no request runs) or a DecoderForCausalLM. token_id_batches:
    token-id lists, or batches of them. The forward runs over a temporary cache in the model's dtype, so the
    engine's own cache (fp8 or not), its scales and its prefix cache play no part and are left as they were."""
    seqs = []
    for batch in token_id_batches:
        seqs += [list(batch)] if batch and isinstance(batch[0], int) else [list(s) for s in batch]
    if not seqs:
        raise ValueError("calibrate_kv_scales: no calibration tokens")
    model = engine_or_model
    if hasattr(engine_or_model, "runner"):                  # an LLMEngine: its token budget bounds activations
        model = engine_or_model.model
        chunk = min(chunk, engine_or_model.config.scheduler.max_num_batched_tokens)
    layers = model.attention_layers
    saved = [(attn.k_cache, attn.v_cache) for attn in layers]
    embed = model.model.embed_tokens.weight          # the model's dtype and device (linears may be packed ints)
    cache = CacheConfig()
    num_blocks = -(-max(len(s) for s in seqs) // cache.block_size)
    runner = ModelRunner(model, model.config, cache, num_blocks, embed.device, embed.dtype)
    bm = BlockManager(num_blocks, cache.block_size, enable_prefix_caching=False)
    observer = runner.kv_observer = KVRangeObserver(layers)
    try:
        for ids in seqs:
            _prefill(runner, bm, ids, chunk)
    finally:
        for attn, (k_cache, v_cache) in zip(layers, saved):
            attn.k_cache, attn.v_cache = k_cache, v_cache
    scales = make_kv_scales(observer.k_amax, observer.v_amax, observer.num_tokens, dtype_max, margin)
    beyond = [i for i, (k, v) in enumerate(zip(observer.k_amax, observer.v_amax)) if max(k, v) > dtype_max]
    if beyond:
        logger.info("KV calibration: layers %s have |K| or |V| beyond %g; an unscaled fp8 cache would clamp them",
                    beyond, dtype_max)
    return scales


def _prefill(runner, bm, token_ids: list[int], chunk: int) -> None:
    seq = Sequence("kv-calibration", token_ids, SamplingParams(max_tokens=None))
    try:
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            assert bm.allocate_slots(seq, n)        # the cache was sized for the longest sequence
            runner.forward(SchedulerOutput([ScheduledSeq(seq, n)], n))
            seq.num_computed_tokens += n
    finally:
        bm.free(seq)
