"""The W4A16 matmul for M = 17..4096 on Hopper (sm90): TMA feeds a shared ring, warpgroups dequantize and issue wgmma.

y^T = W^T x^T as in kernels/matmul/frag/mma.py: the dequantized weight tile [BLOCK_N, BLOCK_K] is wgmma's A operand
straight from registers (the fragment layout's words dequantize into it, kernels/matmul/frag/tiles.py), x^T its B
operand from shared memory. One producer warp only issues TMA copies: a step's fragment words (one box of
[BLOCK_N / 16, 2 BLOCK_K] int32) and x's [BLOCK_M, BLOCK_K] tile land in a ring stage and signal `ready` with their
bytes; the consumers (one or two warpgroups, each a partition of its own with 64 or 128 weight rows) wait for it,
read the words from shared memory, dequantize, issue wgmma, wait for it and free the stage (`empty`). With one
consumer, two programs share an SM (128 registers a thread); with two, one program (232 for the consumers). One
consumer may overlap (`overlap`): each step's dequant runs beside the previous step's wgmma, whose A tile stays
live in a second register set until a wait(1) retires it (ptxas keeps the wgmmas asynchronous there; in a
consumer that is a worker partition, as the second of two is, it serializes them for want of registers, C7512).
Why this shape (lab log entries 12, 15, 17): the register-fed loop of w4a16_mma had one DRAM round
trip a step in its critical path (latency-bound at 128 rows); the older warp-specialized kernel copied x by cp.async
from four producer warps, whose copies for every narrow tile bound it. Here a copy is one instruction, as many steps
ahead as the ring has stages, and the scales (one row a group) are the only loads the consumers issue, two steps
ahead.
The grid is persistent (stream-K, lab log entry 26): whole tiles in waves of the resident programs,
then the tiles of the last, partial wave cut by K steps over all of them (equal ranges a tile where that fills the
SMs, else even spans across tiles; kernels/matmul/streamk.py), their fp32 partials summed in fixed order. A grid of
one program a tile left a quarter to half of the SMs idle in its last wave (gate_up at M = 64: 59 us; 41 now).
"""
import torch

from quant_serve.kernels.triton_compat import (gl, gluon, triton, TensorDescriptor, mbarrier, tma, warpgroup_mma,
                                               warpgroup_mma_init, warpgroup_mma_wait)
from quant_serve.kernels.pdl import gl_pdl_start, gl_pdl_wait, launch_options, pdl_enabled
from quant_serve.kernels.norm_act import silu_and_mul
from quant_serve.kernels.matmul.frag.layout import FragWeights, pick_block_k
from quant_serve.kernels.matmul.streamk import _sk_owner, _sk_span, launch_sk_reduce, stream_k_plan
from quant_serve.kernels.gpu import device_sms
from quant_serve.kernels.matmul.frag.tiles import _dequant_step, _load_group, _tile_words, mma_layout, word_layout

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.constexpr_function
def smem_word_layout(num_warps, rn, rk):
    """The layout in which a consumer reads a stage's words [NT = BLOCK_N / 16, 128 RK] (a box of the fragment
    layout: per 16-row tile and 64-row block, 32 lanes x 4 words): each thread 16 contiguous bytes, a warp one
    512-byte run. Reshaped to [NG, RK, 4, 4] it is `word_layout` (checked at compile time)."""
    reg = [[0, 1], [0, 2]] + [[0, 128 << i] for i in range(rk.bit_length() - 1)] + \
          [[num_warps << i, 0] for i in range(rn.bit_length() - 1)]
    lane = [[0, 4], [0, 8], [0, 16], [0, 32], [0, 64]]
    warp = [[1 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [8 * num_warps * rn // 8, 128 * rk])


@gluon.jit
def _produce(w_desc, x_desc, w_ring, x_ring, ready, empty, tile, k0, k1, i, m_tiles, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Steps [k0, k1) of `tile`: each step's words and x tile into ring stage i % STAGES once it is free. -> i."""
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    m0 = (tile % m_tiles) * BLOCK_M
    nt0 = (tile // m_tiles) * (BLOCK_N // 16)
    for it in range(k0, k1):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)     # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(w_desc, [nt0, it * (2 * BLOCK_K)], ready.index(s), w_ring.index(s))
        _tma_load(x_desc, [m0, it * BLOCK_K], ready.index(s), x_ring.index(s))
        i += 1
    return i


@gluon.jit
def _tma_producer(w_desc, x_desc, w_ring, x_ring, ready, empty, m_tiles, steps, waves, tail, p_sk,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's work (`_tma_consumer`'s order) into the ring."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    i = 0
    for j in range(waves):
        i = _produce(w_desc, x_desc, w_ring, x_ring, ready, empty, pid + j * P, 0, steps, i, m_tiles, BLOCK_M,
                     BLOCK_N, BLOCK_K, STAGES)
    if pid < p_sk:
        u0, u1, base, extra = _sk_span(pid, p_sk, tail * steps)
        for t in range(u0 // steps, (u1 + steps - 1) // steps):
            i = _produce(w_desc, x_desc, w_ring, x_ring, ready, empty, waves * P + t,
                         gl.maximum(u0, t * steps) - t * steps, gl.minimum(u1, t * steps + steps) - t * steps, i,
                         m_tiles, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)


@gluon.jit
def _tma_issue(acc, g, it, r, k1, w_ring, x_ring, ready, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg,
               WG: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, HALF: gl.constexpr,
               BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_L: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr):
    """Step `it` of a consumer warpgroup from ring slot r: wait for stage r % STAGES, dequantize its words with the
    group rows `g` into the A registers, issue the wgmma. -> (acc token, the A tile it reads, the group rows of step
    it + 2)."""
    RK: gl.constexpr = BLOCK_K // 64
    s = r % STAGES
    mbarrier.wait(ready.index(s), (r // STAGES) & 1)
    w = w_ring.index(s).slice(WG * (HALF // 16), HALF // 16).load(SL)     # [HALF / 16, 128 RK]
    w = gl.permute(gl.reshape(w, [HALF // 16, RK, 8, 4, 4]), [0, 2, 1, 3, 4])
    w = gl.convert_layout(gl.reshape(w, [HALF // 2, RK, 4, 4]), WL, assert_trivial=True)
    a = _dequant_step(w, g[0], g[1], g[2], g[3], n_lo, n_hi, ZP_MODE, HALF, BLOCK_K, A_L)
    g = _load_group(gl.minimum(it + 2, k1 - 1) * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg,
                    GROUP, ZP_MODE)
    acc = warpgroup_mma(a, x_ring.index(s).permute((1, 0)), acc, is_async=True)
    return acc, a, g


@gluon.jit
def _tma_step(acc, g, it, r, k1, w_ring, x_ring, ready, empty, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg,
              stride_zg, WG: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, HALF: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_L: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr):
    """Step `it`, its wgmma waited for at once, its stage freed. -> (acc, the group rows of step it + 2).
    Without the overlap the other warpgroup, or the SM's other program, fills the tensor cores during a dequant.
    (The A tile through a shared double buffer measured slower at every shape: lab log entry 25;
    the two consumers' wgmmas in turn, by mbarriers, slower at 19 of 20 points: exp-tma-pingpong-h200.json.)"""
    acc, a, g = _tma_issue(acc, g, it, r, k1, w_ring, x_ring, ready, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg,
                           stride_zg, WG, GROUP, ZP_MODE, HALF, BLOCK_K, STAGES, A_L, WL, SL)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(empty.index(r % STAGES), count=1)
    return acc, g


@gluon.jit
def _store_y(acc, out_ptr, bias_ptr, n0, m0, M, N, stride_om, HAS_BIAS: gl.constexpr, HALF: gl.constexpr,
             BLOCK_M: gl.constexpr, MMA: gl.constexpr):
    """acc fp32 [HALF, BLOCK_M] (rows n0.., columns m0.. of y^T) -> y (+ bias). y[m, n] is contiguous along n,
    which the wgmma layout spreads over lanes two bytes at a time: through shared memory into 16 contiguous bytes a
    thread."""
    if HAS_BIAS:
        on = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
        acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
    TPN: gl.constexpr = HALF // 8
    OUT_L: gl.constexpr = gl.BlockedLayout([8, 1], [TPN, 32 // TPN], [1, 4], [0, 1])
    y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT_L)
    on = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, OUT_L))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT_L))
    gl.store(out_ptr + om[None, :] * stride_om + on[:, None], y, mask=(om < M)[None, :] & (on < N)[:, None])


@gluon.jit
def _consume(tile, k0, k1, r, seg, nseg, t_sk, w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr,
             bias_ptr, M, N, KP, m_tiles, max_segs, stride_om, stride_sg, stride_zg, WG: gl.constexpr,
             HAS_BIAS: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr, OVERLAP: gl.constexpr):
    """Steps [k0, k1) of `tile` for warpgroup WG's HALF rows, from ring slot r on: y, or where the tile is split
    in nseg > 1 stream-K segments, this one's fp32 partial into workspace slot seg of the tile, which
    kernels/matmul/streamk.py sums. -> the next ring slot."""
    HALF: gl.constexpr = BLOCK_N // CONSUMERS
    MMA: gl.constexpr = mma_layout(True, 4, BLOCK_M)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = word_layout(4, HALF // 64, BLOCK_K // 64)
    SL: gl.constexpr = smem_word_layout(4, HALF // 64, BLOCK_K // 64)
    half = (tile // m_tiles) * CONSUMERS + WG                         # this warpgroup's HALF-row tile of W^T
    m0 = (tile % m_tiles) * BLOCK_M
    _, _, n_lo, n_hi, k_in = _tile_words(half, N, KP, GROUP, EVEN_N, HALF, BLOCK_K, 4)
    acc = gl.zeros([HALF, BLOCK_M], gl.float32, MMA)
    # two sets of scale / zero rows (the loop unrolled twice), each loaded two steps before its use into the
    # registers its last use just freed: a loop carrying one set would move it at the step's end, and the move
    # waits for the load (a round trip a step; four sets measured the same as two: lab log entry 25)
    g_even = _load_group(k0 * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP, ZP_MODE)
    g_odd = _load_group(gl.minimum(k0 + 1, k1 - 1) * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg,
                        GROUP, ZP_MODE)
    if OVERLAP:     # each step's dequant beside the previous step's wgmma; A tiles alternate between two sets
        acc, a_e, g_even = _tma_issue(acc, g_even, k0, r, k1, w_ring, x_ring, ready, s_ptr, z_ptr, n_lo, n_hi, k_in,
                                      stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF, BLOCK_K, STAGES, A_L, WL, SL)
        for it in range(k0 + 1, k1 - 1, 2):
            acc, a_o, g_odd = _tma_issue(acc, g_odd, it, r + it - k0, k1, w_ring, x_ring, ready, s_ptr, z_ptr, n_lo,
                                         n_hi, k_in, stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF, BLOCK_K,
                                         STAGES, A_L, WL, SL)
            acc, a_e = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a_e])
            mbarrier.arrive(empty.index((r + it - 1 - k0) % STAGES), count=1)
            acc, a_e, g_even = _tma_issue(acc, g_even, it + 1, r + it + 1 - k0, k1, w_ring, x_ring, ready, s_ptr,
                                          z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF,
                                          BLOCK_K, STAGES, A_L, WL, SL)
            acc, a_o = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a_o])
            mbarrier.arrive(empty.index((r + it - k0) % STAGES), count=1)
            acc = warpgroup_mma_init(acc)          # the loop carries the token of the wgmma in flight
        if (k1 - k0) % 2 == 0:
            acc, a_o, g_odd = _tma_issue(acc, g_odd, k1 - 1, r + k1 - 1 - k0, k1, w_ring, x_ring, ready, s_ptr,
                                         z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF,
                                         BLOCK_K, STAGES, A_L, WL, SL)
            acc, a_e = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a_e])
            mbarrier.arrive(empty.index((r + k1 - 2 - k0) % STAGES), count=1)
            acc, a_o = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a_o])
            acc = warpgroup_mma_init(acc)
        else:
            acc, a_e = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a_e])
            acc = warpgroup_mma_init(acc)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])    # (a token on both branches: one type)
        mbarrier.arrive(empty.index((r + k1 - 1 - k0) % STAGES), count=1)
    else:
        for it in range(k0, k1, 2):
            acc, g_even = _tma_step(acc, g_even, it, r + it - k0, k1, w_ring, x_ring, ready, empty, s_ptr, z_ptr,
                                    n_lo, n_hi, k_in, stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF, BLOCK_K,
                                    STAGES, A_L, WL, SL)
            if it + 1 < k1:
                acc, g_odd = _tma_step(acc, g_odd, it + 1, r + it + 1 - k0, k1, w_ring, x_ring, ready, empty, s_ptr,
                                       z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, WG, GROUP, ZP_MODE, HALF,
                                       BLOCK_K, STAGES, A_L, WL, SL)
    if nseg == 1:
        _store_y(acc, out_ptr, bias_ptr, half * HALF, m0, M, N, stride_om, HAS_BIAS, HALF, BLOCK_M, MMA)
    else:   # the partial, x row-major ([BLOCK_M, HALF]: the reduce pass writes y's rows from it contiguously)
        rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        slot = (t_sk * CONSUMERS + WG) * max_segs + seg
        gl.store(ws_ptr + slot * (HALF * BLOCK_M) + cols[None, :] * HALF + rows[:, None], acc)
    return r + k1 - k0


@gluon.jit
def _tma_consumer(w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, m_tiles,
                  steps, waves, tail, p_sk, max_segs, stride_om, stride_sg, stride_zg, WG: gl.constexpr,
                  HAS_BIAS: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr, OVERLAP: gl.constexpr):
    """Warpgroup WG (a partition of its own, so two never wait at each other's barriers): rows
    [WG * HALF, (WG + 1) * HALF) of each tile, HALF = BLOCK_N / CONSUMERS. The program's work: whole tiles pid,
    pid + P, ... (`waves` of them), then, for the first p_sk programs, its stream-K span of the `tail` tiles left."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    r = 0
    for j in range(waves):
        r = _consume(pid + j * P, 0, steps, r, 0, 1, 0, w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr,
                     bias_ptr, M, N, KP, m_tiles, max_segs, stride_om, stride_sg, stride_zg, WG, HAS_BIAS,
                     GROUP, ZP_MODE, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS, OVERLAP)
    if pid < p_sk:
        u0, u1, base, extra = _sk_span(pid, p_sk, tail * steps)
        for t in range(u0 // steps, (u1 + steps - 1) // steps):
            first = _sk_owner(t * steps, base, extra)
            r = _consume(waves * P + t, gl.maximum(u0, t * steps) - t * steps,
                         gl.minimum(u1, t * steps + steps) - t * steps, r, pid - first,
                         _sk_owner(t * steps + steps - 1, base, extra) - first + 1, t, w_ring, x_ring, ready, empty,
                         s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, m_tiles, max_segs, stride_om,
                         stride_sg, stride_zg, WG, HAS_BIAS, GROUP, ZP_MODE, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K,
                         STAGES, CONSUMERS, OVERLAP)


@gluon.jit(do_not_specialize=["M", "m_tiles", "waves", "tail", "p_sk", "max_segs"])   # one compile per tile
def _w4a16_tma_kernel(w_desc, x_desc, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, m_tiles, waves,
                      tail, p_sk, max_segs, stride_om, stride_sg, stride_zg, HAS_BIAS: gl.constexpr,
                      GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr, PDL: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                      OVERLAP: gl.constexpr):
    """y = x @ W (+ bias) over a persistent grid of P programs (num_warps = 4: the first consumer warpgroup).
    Tiles [BLOCK_M, BLOCK_N] are numbered along M first (programs in flight together share a weight tile); the
    first waves * P are whole tiles, program p taking p, p + P, ...; the `tail` tiles after them are split by K
    steps evenly over the first p_sk programs (stream-K), so that no SM idles through a last partial wave."""
    steps = KP // BLOCK_K
    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N // 16, 2 * BLOCK_K], w_desc.layout)
    x_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)    # one arrival a consumer warpgroup
    gl_pdl_wait(PDL)                                       # x is the previous kernel's output
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP,
                             m_tiles, steps, waves, tail, p_sk, max_segs, stride_om, stride_sg, stride_zg, 0,
                             HAS_BIAS, GROUP, ZP_MODE, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS,
                             OVERLAP)),
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP,
                             m_tiles, steps, waves, tail, p_sk, max_segs, stride_om, stride_sg, stride_zg, 1,
                             HAS_BIAS, GROUP, ZP_MODE, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS,
                             OVERLAP)),
            (_tma_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, m_tiles, steps, waves, tail, p_sk,
                             BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP,
                             m_tiles, steps, waves, tail, p_sk, max_segs, stride_om, stride_sg, stride_zg, 0,
                             HAS_BIAS, GROUP, ZP_MODE, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS,
                             OVERLAP)),
            (_tma_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, m_tiles, steps, waves, tail, p_sk,
                             BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        ], [1], [PRODUCER_REGS])
    gl_pdl_start(PDL)              # the next kernel in only now: its programs waiting early would hold SM room


def register_budget(consumers: int) -> tuple[int, int, int | None]:
    """(registers a consumer thread, a producer thread, the launch's maxnreg or None): one consumer takes 128 a
    thread so that two programs share an SM (232 + 24 over its two warpgroups, setmaxnreg); two take 232 each
    beside a 40-register producer, one program an SM (Triton's default budget for 12 warps)."""
    return (232, 40, None) if consumers == 2 else (232, 24, 128)


def tma_works_for(x: torch.Tensor, fw: FragWeights) -> bool:
    """Whether w4a16_tma takes this call: fp16 x with 16-byte aligned rows (TMA), N a multiple of 16, not Q6_K
    (its high-bit words come with the words, which the TMA kernel copies to shared memory)."""
    return (x.dtype == torch.float16 and (fw.scales.dtype == torch.float16 or fw.zp_mode == 3) and fw.hi is None
            and x.stride(1) == 1
            and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0 and fw.out_features % 16 == 0)


def w4a16_tma(x: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None, block_n: int = 128,
              block_m: int | None = None, block_k: int = 64, stages: int = 4, consumers: int = 2,
              silu_mul: bool = False, sk_programs: int = 0, overlap: bool = False) -> torch.Tensor:
    """x fp16 [M, K] (already permuted for act-order; rows 16-byte aligned) -> [M, N], or [M, N / 2] =
    silu(gate) * up with silu_mul (the silu_and_mul kernel after), on an sm90 GPU.
    consumers: warpgroups a program (2: 232 registers each, one program an SM; 1: two programs an SM);
    block_n / consumers = 64 or 128 weight rows a warpgroup; block_m 16..256 (wgmma's N; default: M rounded up to a
    power of two, at most 256), block_k 64 or 128, stages: the ring's depth; sk_programs: programs that share the
    last partial wave's tiles by K steps (0: stream_k_plan's choice; the number of those tiles: none split);
    overlap: each step's dequant beside the previous step's wgmma (one consumer; ignored with two)."""
    m, k = x.shape
    n = fw.out_features
    kp = fw.words.shape[1] // 2
    if consumers not in (1, 2) or block_n // consumers not in (64, 128) or block_n % consumers:
        raise ValueError(f"block_n / consumers must be 64 or 128, got {block_n} / {consumers}")
    if not tma_works_for(x, fw):
        raise ValueError("w4a16_tma needs fp16 x and scales, 16-byte aligned rows of x and N % 16 == 0")
    group = fw.group_size if fw.scales.shape[0] > 1 else 0
    bk = pick_block_k(kp, group, block_k)
    block_m = block_m or min(128 * consumers, max(16, triton.next_power_of_2(m)))
    if block_m > 128 * consumers:
        raise ValueError(f"block_m {block_m} is above {128 * consumers} rows for {consumers} consumer warpgroup(s)")
    m_tiles = triton.cdiv(m, block_m)
    plan = stream_k_plan(m_tiles * triton.cdiv(n, block_n), kp // bk, device_sms(x.device) * (3 - consumers),
                         sk_programs)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w_desc = TensorDescriptor(fw.words, [n // 16, kp * 2], [kp * 2, 1], [block_n // 16, 2 * bk], w_layout)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, bk],
                              gl.NVMMASharedLayout.get_default_for([block_m, bk], gl.float16))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # the partials of split tiles (typed fp32 even where none is split: the kernel is compiled for one signature)
    ws = torch.empty(plan.tail * plan.max_segs * block_n * block_m if plan.max_segs > 1 else 1,
                     dtype=torch.float32, device=x.device)
    consumer_regs, producer_regs, maxnreg = register_budget(consumers)
    pdl = pdl_enabled(x)
    zeros, stride_zg = fw.zero_args()
    _w4a16_tma_kernel[(plan.programs,)](
        w_desc, x_desc, fw.scales, zeros, out, ws,
        bias if bias is not None else out, m, n, kp, m_tiles, plan.waves, plan.tail, plan.sk_programs,
        plan.max_segs, out.stride(0), fw.scales.stride(0), stride_zg,
        HAS_BIAS=bias is not None, GROUP=group or (1 << 30), ZP_MODE=fw.zp_mode,
        EVEN_N=n % block_n == 0, PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, STAGES=stages,
        CONSUMERS=consumers, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
        OVERLAP=overlap and consumers == 1,
        num_warps=4,
        **launch_options(pdl), **({"maxnreg": maxnreg} if maxnreg else {}))
    if plan.max_segs > 1:
        launch_sk_reduce(ws, out, bias, plan, m, n, kp, m_tiles, block_m, block_n, bk, consumers)
    return silu_and_mul(out) if silu_mul else out
