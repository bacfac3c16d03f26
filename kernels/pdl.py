"""Programmatic dependent launch (PDL, sm90+): the next kernel of a stream starts while this one still runs.

A decode step is ~300 short dependent kernels. Without PDL each one waits for the previous kernel to finish and
then pays its own start-up: launch, the first DRAM round trip of its weights. With PDL every kernel of the decode
path is launched with the programmatic-serialization attribute and follows three rules:

1. `launch_dependents`: the next kernel may be scheduled once every program of this one has passed it (short
   kernels: at the top; the W4A16 matmul: after its main loop, so only one kernel waits ahead of it);
2. before `wait`, it reads only weights (never written during serving): the W4A16 matmul loads its first step's
   words while the previous kernel (a norm, the attention) still runs;
3. every program calls `wait` on every path before it reads or writes any activation, workspace or counter:
   `wait` returns when the previous kernel has finished and its writes are visible, and since that kernel waited
   for its own predecessor, everything launched before is done too.

Kernels launched without the attribute (torch ops, cuBLAS) wait for their predecessor as usual, so the two kinds mix.
KernelOptions.pdl = False turns it off (kernels/gpu.py); off the GPU, in the interpreter, below sm90 and under the
profile of a card without it (an A10, a 4090) it is off.
"""
import functools

import torch

from quant_serve.kernels.gpu import runtime_for

from quant_serve.kernels.triton_compat import gl, gluon, tl, triton, gdc_launch_dependents, gdc_wait, interpreting

@functools.cache
def _triton_launches_pdl() -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def pdl_enabled(t: torch.Tensor) -> bool:
    """Launch the kernels that take `t` with PDL? (CUDA graphs keep the launches they captured.)"""
    if not t.is_cuda or interpreting():
        return False
    return runtime_for(t.device).pdl and _triton_launches_pdl()


def launch_options(pdl: bool) -> dict:
    """Extra launch keywords of a kernel launched with PDL (pass PDL=pdl as its constexpr too)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Rule 1, for Triton kernels."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Rule 3, for Triton kernels."""
    if PDL:
        gdc_wait()


@gluon.jit
def gl_pdl_start(PDL: gl.constexpr):
    """Rule 1, for Gluon kernels."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def gl_pdl_wait(PDL: gl.constexpr):
    """Rule 3, for Gluon kernels."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
