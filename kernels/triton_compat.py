"""The one place kernels/ imports Triton from, so that the package imports where Triton is not installed.

Triton ships wheels for Linux only. On macOS and Windows (and on a Linux box where it is missing) every module of
kernels/ still imports: the names below become placeholders, `@triton.jit` / `@gluon.jit` functions become
`MissingTritonKernel`s that raise a clear error when launched, and the torch twins (the CPU path) run as usual. A
placeholder used as a number (`triton.cdiv(...) + 1`, `if placeholder:`) raises the same error instead of computing
garbage. vLLM does the same (vllm/triton_utils).
"""
from __future__ import annotations

_MESSAGE = ("Triton is not installed, so the Triton kernel {name!r} cannot run; install triton (Linux) or keep the "
            "tensors on the CPU, where the torch twins run")


class MissingTritonKernel:
    """What `@triton.jit` / `@gluon.jit` give a function when Triton is missing."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _fail(self, *args, **kwargs):
        raise RuntimeError(_MESSAGE.format(name=self.__name__))

    __call__ = __getitem__ = _fail


class _Missing:
    """Stands for any Triton object at import time (modules, `tl.constexpr(...)`, layouts, decorator factories)."""

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name: str) -> "_Missing":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Missing):
            return MissingTritonKernel(args[0])          # used as a bare decorator
        return _Missing(f"{self._path}(...)")            # a decorator factory, a constexpr, a layout

    def _fail(self, *args, **kwargs):
        raise RuntimeError(_MESSAGE.format(name=self._path))

    __bool__ = __int__ = __index__ = __float__ = __iter__ = __len__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __floordiv__ = __truediv__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = _fail

    def __repr__(self) -> str:
        return f"<missing {self._path}>"


try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:   # no wheel for this platform
    HAS_TRITON = False
    triton = _Missing("triton")
    tl = _Missing("triton.language")

if HAS_TRITON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
else:
    gluon = _Missing("triton.experimental.gluon")
    gl = _Missing("triton.experimental.gluon.language")
    async_copy = _Missing("gluon.nvidia.ampere.async_copy")
    mma_v2 = _Missing("gluon.nvidia.ampere.mma_v2")
    fence_async_shared = _Missing("gluon.nvidia.hopper.fence_async_shared")
    mbarrier = _Missing("gluon.nvidia.hopper.mbarrier")
    tma = _Missing("gluon.nvidia.hopper.tma")
    warpgroup_mma = _Missing("gluon.nvidia.hopper.warpgroup_mma")
    warpgroup_mma_init = _Missing("gluon.nvidia.hopper.warpgroup_mma_init")
    warpgroup_mma_wait = _Missing("gluon.nvidia.hopper.warpgroup_mma_wait")
    TensorDescriptor = _Missing("gluon.nvidia.hopper.TensorDescriptor")
    gdc_launch_dependents = _Missing("triton.language.extra.cuda.gdc_launch_dependents")
    gdc_wait = _Missing("triton.language.extra.cuda.gdc_wait")



def interpreting() -> bool:
    """Triton runs its interpreter (TRITON_INTERPRET=1, Triton's own setting, read through its knobs): the CPU
    tests. Inline asm, PDL and other compiled-only features must then stay off."""
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)


__all__ = ["HAS_TRITON", "interpreting", "MissingTritonKernel", "TensorDescriptor", "async_copy", "fence_async_shared",
           "gdc_launch_dependents", "gdc_wait", "gl", "gluon", "mbarrier", "mma_v2", "tl", "tma", "triton",
           "warpgroup_mma", "warpgroup_mma_init", "warpgroup_mma_wait"]
