"""The W4A16 matmul for M = 33..2047 on Hopper (sm90): TMA feeds a shared ring, warpgroups dequantize and issue wgmma.

y^T = W^T x^T as in kernels/w4a16_mma.py: the dequantized weight tile [BLOCK_N, BLOCK_K] is wgmma's A operand
straight from registers (the fragment layout's words dequantize into it, kernels/w4a16_tiles.py), x^T its B
operand from shared memory. One producer warp only issues TMA copies: a step's fragment words (one box of
[BLOCK_N / 16, 2 BLOCK_K] int32) and x's [BLOCK_M, BLOCK_K] tile land in a ring stage and signal `ready` with their
bytes; the consumers (one or two warpgroups, each a partition of its own with 64 or 128 weight rows) wait for it,
read the words from shared memory, dequantize, issue wgmma, wait for it and free the stage (`empty`). With one
consumer, two programs share an SM (128 registers a thread); with two, one program (232 for the consumers).
Why this shape (bench/NOTES-kernels.md entries 12, 15, 17): the register-fed loop of w4a16_mma had one DRAM round
trip a step in its critical path (latency-bound at 128 rows); the older warp-specialized kernel copied x by cp.async
from four producer warps, whose copies for every narrow tile bound it. Here a copy is one instruction, as many steps
ahead as the ring has stages, and the scales (one row a group) are the only loads the consumers issue, two steps
ahead.
Split-K partials go through the workspace and the reduce pass (kernels/w4a16_splitk.py).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.pdl import gl_pdl_start, gl_pdl_wait, launch_options, pdl_enabled
from kernels.norm_act import silu_and_mul
from kernels.w4a16_frag import FragWeights, pick_block_k
from kernels.w4a16_splitk import launch_splitk_reduce, split_buffers
from kernels.w4a16_tiles import _dequant_step, _load_group, _tile_words, mma_layout, word_layout

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
def _tma_producer(w_desc, x_desc, w_ring, x_ring, ready, empty, nt0, m0, it0, it1, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr):
    """One warp: each step's words and x tile into its stage once the consumers freed it."""
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for it in range(it0, it1):
        i = it - it0
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)     # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(s), nbytes)
        _tma_load(w_desc, [nt0, it * (2 * BLOCK_K)], ready.index(s), w_ring.index(s))
        _tma_load(x_desc, [m0, it * BLOCK_K], ready.index(s), x_ring.index(s))


@gluon.jit
def _tma_step(acc, g, it, it0, it1, w_ring, x_ring, ready, empty, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg,
              stride_zg, WG: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, HALF: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, A_L: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr):
    """One step of a consumer warpgroup: wait for stage (it - it0) % STAGES, dequantize its words with the group
    rows `g` into the A registers, wgmma, free the stage. -> (acc, the group rows of step it + 2).
    The wgmma is waited for at once: with the next step's dequant in flight beside it, ptxas serializes every
    wgmma (C7513: registers a wgmma reads are defined while one runs); the other warpgroup, or the SM's other
    program, fills the tensor cores meanwhile. (The A tile through a shared double buffer, so that the wgmma runs
    during the next dequant, measured slower at every shape: bench/NOTES-kernels.md entry 25.)"""
    RK: gl.constexpr = BLOCK_K // 64
    i = it - it0
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    w = w_ring.index(s).slice(WG * (HALF // 16), HALF // 16).load(SL)     # [HALF / 16, 128 RK]
    w = gl.permute(gl.reshape(w, [HALF // 16, RK, 8, 4, 4]), [0, 2, 1, 3, 4])
    w = gl.convert_layout(gl.reshape(w, [HALF // 2, RK, 4, 4]), WL, assert_trivial=True)
    a = _dequant_step(w, g[0], g[1], g[2], g[3], n_lo, n_hi, HAS_ZEROS, HALF, BLOCK_K, A_L)
    g = _load_group(gl.minimum(it + 2, it1 - 1) * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg,
                    GROUP, HAS_ZEROS)
    acc = warpgroup_mma(a, x_ring.index(s).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(empty.index(s), count=1)
    return acc, g


@gluon.jit
def _tma_consumer(w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, pid_n, m0, pid_k, M, N, KP,
                  stride_om, stride_sg, stride_zg, it0, it1, WG: gl.constexpr, HAS_BIAS: gl.constexpr,
                  SPLIT: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr,
                  PDL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Warpgroup WG (a partition of its own, so two never wait at each other's barriers): rows
    [WG * HALF, (WG + 1) * HALF) of the tile, HALF = BLOCK_N / CONSUMERS. Per stage: its words -> A registers -> wgmma, then the
    stage is released once the wgmma retired. Then its rows of y (or of the split's fp32 partial) are stored."""
    HALF: gl.constexpr = BLOCK_N // CONSUMERS
    MMA: gl.constexpr = mma_layout(True, 4, BLOCK_M)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    RN: gl.constexpr = HALF // 64
    RK: gl.constexpr = BLOCK_K // 64
    WL: gl.constexpr = word_layout(4, RN, RK)
    SL: gl.constexpr = smem_word_layout(4, RN, RK)
    tile = pid_n * CONSUMERS + WG                                   # this warpgroup's HALF-row tile of W^T
    _, _, n_lo, n_hi, k_in = _tile_words(tile, N, KP, GROUP, EVEN_N, HALF, BLOCK_K, 4)
    acc = gl.zeros([HALF, BLOCK_M], gl.float32, MMA)
    # two sets of scale / zero rows (the loop unrolled twice), each loaded two steps before its use into the
    # registers its last use just freed: a loop carrying one set would move it at the step's end, and the move
    # waits for the load (a round trip a step; four sets measured the same as two: bench/NOTES-kernels.md entry 25)
    g_even = _load_group(it0 * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP, HAS_ZEROS)
    g_odd = _load_group(gl.minimum(it0 + 1, it1 - 1) * BLOCK_K, s_ptr, z_ptr, n_lo, n_hi, k_in, stride_sg, stride_zg,
                        GROUP, HAS_ZEROS)
    for it in range(it0, it1, 2):
        acc, g_even = _tma_step(acc, g_even, it, it0, it1, w_ring, x_ring, ready, empty, s_ptr, z_ptr, n_lo, n_hi,
                                k_in, stride_sg, stride_zg, WG, GROUP, HAS_ZEROS, HALF, BLOCK_K, STAGES, A_L, WL, SL)
        if it + 1 < it1:
            acc, g_odd = _tma_step(acc, g_odd, it + 1, it0, it1, w_ring, x_ring, ready, empty, s_ptr, z_ptr, n_lo,
                                   n_hi, k_in, stride_sg, stride_zg, WG, GROUP, HAS_ZEROS, HALF, BLOCK_K, STAGES, A_L,
                                   WL, SL)
    on = tile * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (on < N)[:, None]
    if SPLIT:
        gl.store(ws_ptr + pid_k * M * N + om[None, :] * N + on[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
        # y[m, n] is contiguous along n, which the wgmma layout spreads over lanes two bytes at a time: through
        # shared memory into 16 contiguous bytes a thread
        TPN: gl.constexpr = HALF // 8
        OUT_L: gl.constexpr = gl.BlockedLayout([8, 1], [TPN, 32 // TPN], [1, 4], [0, 1])
        y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT_L)
        on = tile * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, OUT_L))
        om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT_L))
        gl.store(out_ptr + om[None, :] * stride_om + on[:, None], y, mask=(om < M)[None, :] & (on < N)[:, None])


@gluon.jit
def _w4a16_tma_kernel(w_desc, x_desc, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, stride_om, stride_sg,
                      stride_zg, iters_per_split, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr, GROUP: gl.constexpr,
                      HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr, PDL: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMERS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """y = x @ W (+ bias) for one [BLOCK_M, BLOCK_N] output tile, or with SPLIT this split's fp32 partial into
    ws[pid_k] for the reduce pass (num_warps = 4: the first consumer warpgroup). Programs run along M first: those
    in flight together share a weight tile."""
    m0 = gl.program_id(0) * BLOCK_M
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    it0 = pid_k * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, KP // BLOCK_K)
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
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, pid_n, m0, pid_k,
                             M, N, KP, stride_om, stride_sg, stride_zg, it0, it1, 0, HAS_BIAS, SPLIT, GROUP,
                             HAS_ZEROS, EVEN_N, PDL, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS)),
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, pid_n, m0, pid_k,
                             M, N, KP, stride_om, stride_sg, stride_zg, it0, it1, 1, HAS_BIAS, SPLIT, GROUP,
                             HAS_ZEROS, EVEN_N, PDL, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS)),
            (_tma_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, pid_n * (BLOCK_N // 16), m0, it0, it1,
                             BLOCK_K, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_tma_consumer, (w_ring, x_ring, ready, empty, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, pid_n, m0, pid_k,
                             M, N, KP, stride_om, stride_sg, stride_zg, it0, it1, 0, HAS_BIAS, SPLIT, GROUP,
                             HAS_ZEROS, EVEN_N, PDL, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMERS)),
            (_tma_producer, (w_desc, x_desc, w_ring, x_ring, ready, empty, pid_n * (BLOCK_N // 16), m0, it0, it1,
                             BLOCK_K, STAGES)),
        ], [1], [PRODUCER_REGS])
    gl_pdl_start(PDL)              # the next kernel in only now: its programs waiting early would hold SM room


def register_budget(consumers: int) -> tuple[int, int, int | None]:
    """(registers a consumer thread, a producer thread, the launch's maxnreg or None): one consumer takes 128 a
    thread so that two programs share an SM (232 + 24 over its two warpgroups, setmaxnreg); two take 232 each
    beside a 40-register producer, one program an SM (Triton's default budget for 12 warps)."""
    return (232, 40, None) if consumers == 2 else (232, 24, 128)


def tma_works_for(x: torch.Tensor, fw: FragWeights) -> bool:
    """Whether w4a16_tma takes this call: fp16 x with 16-byte aligned rows (TMA), N a multiple of 16."""
    return (x.dtype == torch.float16 and fw.scales.dtype == torch.float16 and x.stride(1) == 1
            and (x.stride(0) * 2) % 16 == 0 and x.data_ptr() % 16 == 0 and fw.out_features % 16 == 0)


def w4a16_tma(x: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None, block_n: int = 128,
              block_m: int | None = None, block_k: int = 64, split_k: int = 1, stages: int = 4,
              consumers: int = 2, silu_mul: bool = False) -> torch.Tensor:
    """x fp16 [M, K] (already permuted for act-order; rows 16-byte aligned) -> [M, N], or [M, N / 2] =
    silu(gate) * up with silu_mul (in the split-K reduce pass where there is one), on an sm90 GPU.
    consumers: warpgroups a program (2: 232 registers each, one program an SM; 1: two programs an SM);
    block_n / consumers = 64 or 128 weight rows a warpgroup; block_m 16..256 (wgmma's N; default: M rounded up to a
    power of two, at most 256), block_k 64 or 128, stages: the ring's depth; split_k > 1: partials + reduce pass."""
    m, k = x.shape
    n = fw.out_features
    kp = fw.words.shape[1] // 2
    if consumers not in (1, 2) or block_n // consumers not in (64, 128) or block_n % consumers:
        raise ValueError(f"block_n / consumers must be 64 or 128, got {block_n} / {consumers}")
    if not tma_works_for(x, fw):
        raise ValueError("w4a16_tma needs fp16 x and scales, 16-byte aligned rows of x and N % 16 == 0")
    group = fw.group_size if fw.scales.shape[0] > 1 else 0
    bk = pick_block_k(kp, group, block_k)
    iters = kp // bk
    per = triton.cdiv(iters, max(1, min(split_k, iters)))
    splits = triton.cdiv(iters, per)
    block_m = block_m or min(128 * consumers, max(16, triton.next_power_of_2(m)))
    if block_m > 128 * consumers:
        raise ValueError(f"block_m {block_m} is above {128 * consumers} rows for {consumers} consumer warpgroup(s)")
    m_tiles, tiles = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    w_desc = TensorDescriptor(fw.words, [n // 16, kp * 2], [kp * 2, 1], [block_n // 16, 2 * bk], w_layout)
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, bk],
                              gl.NVMMASharedLayout.get_default_for([block_m, bk], gl.float16))
    out, ws, _ = split_buffers(x, m, n, splits, False, tiles * m_tiles, n // 2 if silu_mul and splits > 1 else 0)
    consumer_regs, producer_regs, maxnreg = register_budget(consumers)
    pdl = pdl_enabled(x)
    _w4a16_tma_kernel[(m_tiles, tiles, splits)](
        w_desc, x_desc, fw.scales, fw.qzeros if fw.qzeros is not None else fw.words, out, ws,
        bias if bias is not None else out, m, n, kp, out.stride(0), fw.scales.stride(0),
        fw.qzeros.stride(0) if fw.qzeros is not None else 0, per, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        GROUP=group or (1 << 30), HAS_ZEROS=fw.qzeros is not None, EVEN_N=n % block_n == 0, PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, STAGES=stages, CONSUMERS=consumers,
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4, **launch_options(pdl),
        **({"maxnreg": maxnreg} if maxnreg else {}))
    if splits > 1:
        launch_splitk_reduce(ws, bias, out, splits, silu_mul)
    elif silu_mul:
        out = silu_and_mul(out)
    return out

