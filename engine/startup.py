"""Engine start: every kernel variant the step shapes reach compiled, the CUDA graphs captured, the warm-up run;
what the engine came up with, logged."""
import logging
import time

from quant_serve.engine.config import EngineConfig
from quant_serve.kernels.precompile import parallel_compile
from quant_serve.engine.warmup import warm_up

logger = logging.getLogger("quant_serve")


def start_kernels(engine, config: EngineConfig, show_progress: bool) -> None:
    """Compile every kernel variant the step shapes reach (in parallel where Triton can), capture the decode
    and verification graphs, and run the warm-up forwards, so that no request waits for a compile."""
    start = time.perf_counter()
    sched, spec = config.scheduler, config.speculative
    graphs = None if config.enforce_eager else \
        engine.runner.plan_decode_graphs(min(sched.max_num_seqs, 512), engine.max_model_len)
    verify = None
    if spec.enabled and not config.enforce_eager:
        verify = engine.runner.plan_verify_graphs(min(spec.disable_by_batch_size, sched.max_num_seqs),
                                                  spec.num_speculative_tokens + 1, engine.max_model_len)
    elif spec.enabled:
        logger.info("verification steps run eagerly (--enforce-eager)")

    def warmup(progress: bool) -> int:
        return warm_up(engine.runner, sched.max_num_batched_tokens, sched.max_num_seqs,
                       engine.max_model_len, progress)
    with parallel_compile(config.kernels.compile_workers) as compiling, engine.model.model.first_layers(2):
        if compiling:
            logger.info("compiling kernels on %d threads", config.kernels.compile_workers)
            warmup(False)
            for planned in (graphs, verify):
                if planned is not None:
                    planned.run_eagerly()
    if graphs is not None:
        engine.runner.capture_decode_graphs(show_progress)
    if verify is not None:
        engine.runner.capture_verify_graphs(show_progress)
    forwards = warmup(show_progress)
    logger.info("kernels ready in %.1f s: %d decode graphs, %d verify graphs, %d warm-up forwards",
                time.perf_counter() - start, 0 if graphs is None else len(graphs.graphs),
                0 if verify is None else len(verify.graphs), forwards)


def log_engine(engine, num_blocks: int, num_cpu_blocks: int) -> None:
    """The engine's model, KV cache and CPU tier, once it is ready."""
    block_size = engine.config.cache.block_size
    logger.info("model %s: %s, %s on %s; %s", engine.model_dir, engine.model_config.architecture,
                str(engine.dtype).replace("torch.", ""), engine.device,
                engine.quant_config.describe() if engine.quant_config else "unquantized")
    logger.info(engine.activations.describe())
    logger.info("KV cache: %d blocks = %d tokens, max concurrency %.1f at max_model_len %d",
                num_blocks, num_blocks * block_size, num_blocks * block_size / engine.max_model_len,
                engine.max_model_len)
    if num_cpu_blocks:
        logger.info("KV CPU tier: %d blocks = %d tokens", num_cpu_blocks, num_cpu_blocks * block_size)
