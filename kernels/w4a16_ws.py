"""Warp-specialized Hopper (sm90) W4A16 matmul over the fragment layout: a producer partition dequantizes, a
warpgroup only issues wgmma. Opt-in (`w4a16_ws`), not dispatched: on the H200 it is correct and slower than the
dispatcher at every M (bench/results/exp-ws-h200.json; why, from probes: bench/NOTES-kernels.md entry 17 — x tiles
re-read from the L2 for every narrow N tile bound the skeleton itself, not the dequant).

Why: in kernels/w4a16_wgmma.py one warpgroup both dequantizes and issues wgmma, and ptxas serializes the two
inside the warp (bench/NOTES-kernels.md entry 15): M = 64 runs at 1.18x FP16, M >= 256 at 1.9x its time. Here
4 producer warps (loads two steps ahead, L2 prefetch further: _ws_producer) dequantize, store the fp16 tile into a
ring of STAGES shared tiles next to a cp.async copy of x's tile, and signal `ready`; the default warpgroup waits for
`ready`, issues wgmma (A and B from shared memory), keeps one in flight and releases the previous stage (`empty`).
y^T = W^T x^T as in w4a16_mma: the weight tile [BLOCK_N, BLOCK_K] is wgmma's A (64 rows a warpgroup instruction),
x^T [BLOCK_K, BLOCK_M] its B. Split-K partials go through the workspace and the reduce pass (kernels/w4a16_splitk.py).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from kernels.norm_act import silu_and_mul
from kernels.pdl import gl_pdl_start, gl_pdl_wait, launch_options, pdl_enabled
from kernels.w4a16_frag import FragWeights, pick_block_k
from kernels.w4a16_splitk import launch_splitk_reduce, split_buffers
from kernels.w4a16_tiles import _dequant_step, _load_step, _tile_words, mma_layout
from kernels.w4a16_wgmma import _cta_barrier, _x_copy

PRODUCER_WARPS = gl.constexpr(4)


@gluon.jit
def _l2_prefetch(ptrs):
    """prefetch.global.L2 of each address in `ptrs` (the line comes into the L2; nothing waits for it)."""
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _prefetch_step(k0, w_ptr, s_ptr, z_ptr, pid_n, N, KP, stride_sg, stride_zg, GROUP: gl.constexpr,
                   HAS_ZEROS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Bring the step at row k0 (its words, scale and zero rows) into the L2: a 16-row tile's words of one step
    are BLOCK_K / 16 contiguous 128-byte lines (kernels/w4a16_frag.py), the scales of BLOCK_N columns BLOCK_N / 64
    lines, their packed zeros one."""
    LPT: gl.constexpr = BLOCK_K // 16
    PL: gl.constexpr = gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0])
    t = gl.arange(0, (BLOCK_N // 16) * LPT, layout=PL)
    nt = gl.minimum(pid_n * (BLOCK_N // 16) + t // LPT, N // 16 - 1)
    _l2_prefetch(w_ptr + nt * (KP * 2) + k0 * 2 + (t % LPT) * 32)
    c = gl.arange(0, BLOCK_N // 64, layout=PL)
    _l2_prefetch(s_ptr + (k0 // GROUP) * stride_sg + gl.minimum(pid_n * BLOCK_N + c * 64, N - 1))
    if HAS_ZEROS:
        _l2_prefetch(z_ptr + (k0 // GROUP) * stride_zg + gl.minimum(pid_n * (BLOCK_N // 8) + c * 8, N // 8 - 1))


@gluon.jit
def _ws_producer(x_ptr, w_ptr, s_ptr, z_ptr, a_ring, x_ring, ready, empty, pid_n, m0, it0, it1, M, N, KP,
                 stride_xm, stride_sg, stride_zg, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr,
                 EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 STAGES: gl.constexpr, PREFETCH: gl.constexpr):
    """The worker partition (PRODUCER_WARPS warps). A wgmma step is a few hundred cycles, a DRAM round trip
    ~2,000: a step's lines are asked into the L2 PREFETCH steps ahead (0: never), its registers loaded two steps
    ahead, and x's tile copied (cp.async) one step ahead into its stage once the consumer freed it. Each step
    dequantizes, stores the tile into its stage and arrives on `ready` once every producer thread's stores and
    copies are visible to the async proxy."""
    PW: gl.constexpr = PRODUCER_WARPS
    MMA_P: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[PW, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_P, k_width=2)
    offs, w_mask, n_lo, n_hi, k_in = _tile_words(pid_n, N, KP, GROUP, EVEN_N, BLOCK_N, BLOCK_K, PW)
    # x's [BLOCK_M, BLOCK_K] tile: 16 contiguous bytes a thread (rows 16-byte aligned: w4a16_ws pads)
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_K // 8), BLOCK_K // 8], [PW, 1], [1, 0])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))[None, :]
    m_mask = (offs_m < M)[:, None]
    if PREFETCH > 0:
        for d in gl.static_range(PREFETCH):
            _prefetch_step(gl.minimum(it0 + d, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, pid_n, N, KP, stride_sg,
                           stride_zg, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    p0 = _load_step(it0 * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, stride_sg, stride_zg,
                    GROUP, HAS_ZEROS, EVEN_N)
    p1 = _load_step(gl.minimum(it0 + 1, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                    stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N)
    _x_copy(x_ring.index(0), x_ptrs + it0 * BLOCK_K, m_mask)   # fresh stages are empty
    for it in range(it0, it1):
        i = it - it0
        s = i % STAGES
        if PREFETCH > 0:
            _prefetch_step(gl.minimum(it + PREFETCH, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, pid_n, N, KP,
                           stride_sg, stride_zg, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
        p2 = _load_step(gl.minimum(it + 2, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi,
                        k_in, stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N)
        a = _dequant_step(*p0, n_lo, n_hi, HAS_ZEROS, BLOCK_N, BLOCK_K, A_L)
        a_ring.index(s).store(a)              # stage s was waited for empty when x(it) was copied into it
        async_copy.wait_group(0)              # x(it)
        fence_async_shared()                  # this thread's generic-proxy stores, before wgmma reads them
        _cta_barrier()                        # every producer thread's stores and copies (a partition barrier)
        mbarrier.arrive(ready.index(s), count=1)
        if it + 1 < it1:                      # x(it + 1) into the next stage once the consumer released it
            mbarrier.wait(empty.index((i + 1) % STAGES), (((i + 1) // STAGES) & 1) ^ 1)
            _x_copy(x_ring.index((i + 1) % STAGES), x_ptrs + (it + 1) * BLOCK_K, m_mask)
        p0 = p1
        p1 = p2


@gluon.jit
def _ws_consumer(a_ring, x_ring, ready, empty, it0, it1, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The default partition (one warpgroup): wgmma on each ready stage, one in flight; the stage before it is
    released once that wgmma has retired. -> acc fp32 [BLOCK_N, BLOCK_M] (y^T)."""
    MMA: gl.constexpr = mma_layout(True, num_warps, BLOCK_M)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    for it in range(it0, it1):
        i = it - it0
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(s), x_ring.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])     # wgmma(i - 1) retired: its stage is free
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    return (acc,)                             # warp_specialize flattens the default partition's results


@gluon.jit
def _w4a16_ws_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, stride_xm, stride_om,
                     stride_sg, stride_zg, iters_per_split, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                     GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr, PDL: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                     PRODUCER_REGS: gl.constexpr, PREFETCH: gl.constexpr, num_warps: gl.constexpr):
    """y = x @ W (+ bias) for one [BLOCK_M, BLOCK_N] output tile (num_warps = 4: the consumer warpgroup), or with
    SPLIT this split's fp32 partial into ws[pid_k] for the reduce pass."""
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = gl.program_id(2) * BLOCK_M
    it0 = pid_k * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, KP // BLOCK_K)
    a_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float16))
    x_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl_pdl_wait(PDL)                          # x is the previous kernel's output
    res = gl.warp_specialize([
        (_ws_consumer, (a_ring, x_ring, ready, empty, it0, it1, BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_ws_producer, (x_ptr, w_ptr, s_ptr, z_ptr, a_ring, x_ring, ready, empty, pid_n, m0, it0, it1, M, N, KP,
                        stride_xm, stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K,
                        STAGES, PREFETCH)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
    acc = res[0]
    gl_pdl_start(PDL)
    MMA: gl.constexpr = mma_layout(True, num_warps, BLOCK_M)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    mask = (om < M)[None, :] & (on < N)[:, None]
    if SPLIT:
        gl.store(ws_ptr + pid_k * M * N + om[None, :] * N + on[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptr + om[None, :] * stride_om + on[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def register_split(block_m: int) -> tuple[int, int]:
    """(producer registers, maxnreg) that compile for sm90 without spills under Triton 3.6 and 3.9 (the consumer
    warpgroup gets the rest: 8 * maxnreg - 4 * producer over its 4 warps, 144-176 a thread): x's copy addresses
    grow with BLOCK_M in the producer, the accumulator in the consumer."""
    return (96, 128) if block_m <= 32 else (104, 136) if block_m <= 64 else (112, 144)


def w4a16_ws(x: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None, block_n: int = 128,
             block_m: int | None = None, block_k: int = 64, split_k: int = 1, stages: int = 4,
             producer_regs: int | None = None, maxnreg: int | None = None, prefetch: int = 6,
             silu_mul: bool = False) -> torch.Tensor:
    """x fp16 [M, K] (already permuted for act-order) -> [M, N] (or silu(gate) * up, [M, N / 2]) on an sm90 GPU.
    block_n 64 or 128 (one or two 64-row wgmmas a step), block_m 16..128 (wgmma's N; default: M rounded up, at
    most 128), stages: the shared ring's depth; producer_regs / maxnreg: the register split between the partitions
    (4 + 4 warps; default: register_split); prefetch: steps between a step's L2 prefetch and its use (0: none)."""
    m, k = x.shape
    n = fw.out_features
    kp = fw.words.shape[1] // 2
    if block_n not in (64, 128):
        raise ValueError(f"block_n must be 64 or 128, got {block_n}")
    if k != kp or x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
        # cp.async copies 16 aligned bytes per thread, which Triton proves only from a row stride divisible by 16
        # elements (its integer specialization): pad K to the packed length (zeros meet the pad rows' codes)
        x = torch.nn.functional.pad(x, (0, kp - k)).contiguous()
    group = fw.group_size if fw.scales.shape[0] > 1 else 0
    bk = pick_block_k(kp, group, block_k)
    iters = kp // bk
    per = triton.cdiv(iters, max(1, min(split_k, iters)))
    splits = triton.cdiv(iters, per)
    block_m = block_m or min(128, max(16, triton.next_power_of_2(m)))
    default_regs, default_max = register_split(block_m)
    m_tiles = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, block_n)
    out, ws, _ = split_buffers(x, m, n, splits, False, tiles * m_tiles, n // 2 if silu_mul and splits > 1 else 0)
    pdl = pdl_enabled(x)
    _w4a16_ws_kernel[(tiles, splits, m_tiles)](
        x, fw.words, fw.scales, fw.qzeros if fw.qzeros is not None else fw.words, out, ws,
        bias if bias is not None else out, m, n, kp, x.stride(0), out.stride(0), fw.scales.stride(0),
        fw.qzeros.stride(0) if fw.qzeros is not None else 0, per, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        GROUP=group or (1 << 30), HAS_ZEROS=fw.qzeros is not None, EVEN_N=n % block_n == 0, PDL=pdl,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, STAGES=stages, PRODUCER_REGS=producer_regs or default_regs,
        PREFETCH=prefetch, num_warps=4, maxnreg=maxnreg or default_max, **launch_options(pdl))
    if splits > 1:
        launch_splitk_reduce(ws, bias, out, splits, silu_mul)
    elif silu_mul:
        out = silu_and_mul(out)
    return out
