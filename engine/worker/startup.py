"""Engine start: every kernel variant the step shapes reach compiled, the CUDA graphs captured, the warm-up run."""
import logging
import time

from quant_serve.engine.config import EngineConfig
from quant_serve.kernels.precompile import parallel_compile
from quant_serve.engine.worker.warmup import warm_up

logger = logging.getLogger("quant_serve")


def start_kernels(runner, model, config: EngineConfig, max_model_len: int, show_progress: bool) -> None:
    """Compile every kernel variant the step shapes reach (in parallel where Triton can), capture the decode
    and verification graphs, and run the warm-up forwards, so that no request waits for a compile."""
    start = time.perf_counter()
    sched, spec = config.scheduler, config.speculative
    graphs = None if config.enforce_eager else \
        runner.plan_decode_graphs(min(sched.max_num_seqs, 512), max_model_len)
    verify = None
    # a verification graph's rows of one sequence would read each other's new K/V quantized (an exact window), and
    # its inputs carry no adapter slots (LoRA): those verifications run eagerly
    if spec.enabled and not config.enforce_eager and runner.exact_rows is None and runner.lora is None:
        verify = runner.plan_verify_graphs(min(spec.disable_by_batch_size, sched.max_num_seqs),
                                           spec.num_speculative_tokens + 1, max_model_len)
    elif spec.enabled and config.enforce_eager:
        logger.info("verification steps run eagerly (--enforce-eager)")

    def warmup(progress: bool) -> int:
        return warm_up(runner, sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len, progress)
    with parallel_compile(config.kernels.compile_workers) as compiling, model.model.first_layers(2):
        if compiling:
            logger.info("compiling kernels on %d threads", config.kernels.compile_workers)
            warmup(False)
            for planned in (graphs, verify):
                if planned is not None:
                    planned.run_eagerly()
    if graphs is not None:
        runner.capture_decode_graphs(show_progress)
    if verify is not None:
        runner.capture_verify_graphs(show_progress)
    forwards = warmup(show_progress)
    logger.info("kernels ready in %.1f s: %d decode graphs, %d verify graphs, %d warm-up forwards",
                time.perf_counter() - start, 0 if graphs is None else len(graphs.graphs),
                0 if verify is None else len(verify.graphs), forwards)


def device_name(device) -> str:
    """'cpu', or the CUDA device with its card's name, for the start-up log."""
    if not str(device).startswith("cuda"):
        return str(device)
    import torch
    return f"{device}, {torch.cuda.get_device_name(torch.device(device))}"
