"""Stream-K for the TMA kernel (kernels/matmul/frag/tma.py): which programs do which K steps of which tiles, and the pass
that sums the split tiles' partials.

A persistent grid of P resident programs does the first waves * P tiles whole (program p: p, p + P, ...); the
`tail` tiles left (fewer than P) are cut by K steps ("units") over the first p_sk programs, `base` units each and
one more for the first `extra`, so that no SM idles through a last partial wave. A tail tile covered by several
programs has one segment each, numbered in K order; each stores its fp32 partial into the tile's workspace slot
and `_sk_reduce_kernel` sums them in segment order (deterministic, whichever finished first).
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.triton_compat import gl, gluon
from quant_serve.kernels.pdl import gl_pdl_start, gl_pdl_wait, launch_options, pdl_enabled


@dataclass(frozen=True)
class StreamKPlan:
    """A persistent grid for kernels/matmul/frag/tma.py: `programs` programs; the first waves * programs tiles whole
    (program p: p, p + programs, ...), the `tail` tiles after them split by K steps over the first `sk_programs`
    (each tile in at most `max_segs` segments; 1: none split, no workspace)."""
    programs: int
    waves: int
    tail: int
    sk_programs: int
    max_segs: int


MIN_SK_STEPS = 8        # a stream-K program's fewest K steps (its prologue and partial cost a few steps' time)
MAX_SK_SPLIT = 8        # the most equal K ranges a tail tile is cut into (the sweep's range)
SK_ALIGNED_FILL = 0.84  # tail tiles cut into equal K ranges, one a program, when that fills this much of a wave


def stream_k_plan(tiles: int, steps: int, slots: int, sk_programs: int = 0) -> StreamKPlan:
    """Whole waves of `slots` resident programs, then the tiles left (all of them below one wave) spread over
    sk_programs programs. 0: each tail tile cut into the same number of equal K ranges, one a program, where that
    fills SK_ALIGNED_FILL of a wave (no tile's partials straddle two programs' spans); else stream-K over as many
    programs as keep MIN_SK_STEPS steps each, at most `slots`. Fitted to bench/results/exp-tma-sk-h200.json:
    the aligned cut won where it fills 85% or more (o at M = 64..512: 224 programs, 9.7 against 10.7 us at M = 64
    for 264), stream-K where the cut leaves 18% of the slots or more idle (qkv at M = 128: 15.4 against 17.5 us for
    216 of 264; down at M = 4096: 795 against 898 us with its 52 tail tiles uncut)."""
    waves, tail = divmod(tiles, slots)
    if not tail:
        return StreamKPlan(slots, waves, 0, 0, 1)
    units = tail * steps
    if not sk_programs:
        split = max(1, min(slots // tail, steps // MIN_SK_STEPS, MAX_SK_SPLIT))
        sk_programs = tail * split if tail * split >= SK_ALIGNED_FILL * slots else max(tail, units // MIN_SK_STEPS)
    p_sk = min(sk_programs, slots, units)
    base = units // p_sk
    if units % p_sk == 0 and (steps % base == 0 or base % steps == 0):       # spans on tile boundaries
        segs = max(1, steps // base)
    else:
        segs = min(p_sk, -(-steps // base) + 1)
    return StreamKPlan(slots if waves else p_sk, waves, tail, p_sk, segs)


@gluon.jit
def _sk_span(pid, p_sk, units):
    """Stream-K: program pid's units (steps of the tail tiles) [u0, u1) of `units` spread over p_sk programs, `base`
    each and one more for the first `extra`."""
    base = units // p_sk
    extra = units % p_sk
    u0 = pid * base + gl.minimum(pid, extra)
    return u0, u0 + base + (pid < extra).to(gl.int32), base, extra


@gluon.jit
def _sk_owner(u, base, extra):
    """The stream-K program whose span holds unit u."""
    big = extra * (base + 1)
    if u < big:
        owner = u // (base + 1)
    else:
        owner = extra + (u - big) // base
    return owner


@gluon.jit(do_not_specialize=["M", "m_tiles", "waves", "programs", "tail", "p_sk", "max_segs"])
def _sk_reduce_kernel(ws_ptr, out_ptr, bias_ptr, M, N, KP, m_tiles, waves, programs, tail, p_sk, max_segs, stride_om,
                      HAS_BIAS: gl.constexpr, PDL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, CONSUMERS: gl.constexpr, CHUNK: gl.constexpr):
    """y of the split tail tiles: program (t * CONSUMERS + wg, c) sums chunk c of warpgroup wg's partials of tail
    tile t in segment order (deterministic), adds the bias and stores it; tiles in one segment were stored whole.
    Four segments' loads are issued together (one round trip for them, not one each: a loop of one load a segment
    was latency-bound under ncu, bench/results/ncu-w4a16-h200.json, with the partials in DRAM; in CUDA-graph timing,
    partials in L2, the two measured within run-to-run spread: exp-tma-reduce-h200.json)."""
    L: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    HALF: gl.constexpr = BLOCK_N // CONSUMERS
    gl_pdl_start(PDL)
    gl_pdl_wait(PDL)                                       # the partials are the matmul's output
    hid = gl.program_id(0)
    t = hid // CONSUMERS
    steps = KP // BLOCK_K
    _, _, base, extra = _sk_span(0, p_sk, tail * steps)
    first = _sk_owner(t * steps, base, extra)
    nseg = _sk_owner(t * steps + steps - 1, base, extra) - first + 1
    if nseg > 1:
        offs = gl.program_id(1) * CHUNK + gl.arange(0, CHUNK, layout=L)
        src = ws_ptr + hid * max_segs * (HALF * BLOCK_M) + offs
        acc = gl.zeros([CHUNK], gl.float32, L)
        step = HALF * BLOCK_M
        for q in range(0, nseg, 4):     # four segments' loads issued together, summed in segment order
            v0 = gl.load(src + q * step)
            v1 = gl.load(src + (q + 1) * step, mask=q + 1 < nseg, other=0.0)
            v2 = gl.load(src + (q + 2) * step, mask=q + 2 < nseg, other=0.0)
            v3 = gl.load(src + (q + 3) * step, mask=q + 3 < nseg, other=0.0)
            acc = acc + v0 + v1 + v2 + v3
        tile = waves * programs + t
        n = (tile // m_tiles) * BLOCK_N + (hid % CONSUMERS) * HALF + offs % HALF
        m = (tile % m_tiles) * BLOCK_M + offs // HALF
        if HAS_BIAS:
            acc += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
        gl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=(m < M) & (n < N))


def launch_sk_reduce(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, plan: StreamKPlan, m: int,
                     n: int, kp: int, m_tiles: int, block_m: int, block_n: int, block_k: int, consumers: int,
                     chunk: int = 512) -> None:
    """out [M, N] of the split tail tiles from the workspace [tail, consumers, max_segs, block_m, block_n / consumers]
    fp32 (bias added here: the matmul stored none into partials)."""
    pdl = pdl_enabled(ws)
    _sk_reduce_kernel[(plan.tail * consumers, block_n // consumers * block_m // chunk)](
        ws, out, bias if bias is not None else out, m, n, kp, m_tiles, plan.waves, plan.programs, plan.tail,
        plan.sk_programs, plan.max_segs, out.stride(0), HAS_BIAS=bias is not None, PDL=pdl, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, CONSUMERS=consumers, CHUNK=chunk, num_warps=4,
        **launch_options(pdl))
