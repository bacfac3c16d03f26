"""Compile the kernels of a set of launches in parallel, before they run.

A cold start compiles every Triton kernel variant the step shapes reach (7B model: a minute on one thread). Inside
`parallel_compile`, a Triton launch compiles instead of running, on a pool of threads (Triton's asynchronous
compile mode: its passes and ptxas run outside the GIL); on exit every compile has finished and sits in Triton's
in-memory and on-disk caches, so the same launches then only run. Torch ops inside still run (on whatever the
skipped kernels left in their outputs): the launches are throwaway, as the engine's warm-up forwards are.
Triton's on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache) makes a restart skip the compiles altogether.
"""
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("quant_serve")


def async_compile_available() -> bool:
    try:
        from triton.runtime import _async_compile  # noqa: F401 - Triton >= 3.5
        from triton.runtime.jit import JITFunction  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def parallel_compile(workers: int):
    """Yields True when launches inside only compile, in parallel (else False: they run as usual, compiling one by
    one: a Triton without the asynchronous compile mode, or workers < 2)."""
    if workers < 2 or not async_compile_available():
        yield False
        return
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-compile") as pool:
        JITFunction.run = compile_only
        try:
            with AsyncCompileMode(pool):
                yield True
        finally:
            JITFunction.run = run
    logger.info("kernels compiled on %d threads in %.1f s", workers, time.perf_counter() - start)
