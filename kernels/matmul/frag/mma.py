"""Gluon W4A16 tensor-core matmul over the fragment layout (tiles: kernels/matmul/frag/tiles.py).

y^T = W^T x^T: the dequantized weight tile [BLOCK_N, BLOCK_K] is the A operand in registers, x^T [BLOCK_K,
BLOCK_M] the B operand. mma.sync m16n8k16 serves M = 1..64 (x staged in shared memory or straight into registers at
M = 1, above by cp.async into a ring of shared tiles and ldmatrix); Hopper's wgmma (sm90) serves any M by 128-row
tiles (kernels/matmul/frag/wgmma.py). Split-K partials go through the workspace: the reduce pass of
kernels/matmul/splitk.py (SwiGLU fused there), or the one-launch ticket whose last split sums them.
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.triton_compat import gl, gluon, triton
from quant_serve.kernels.attention.merge import DecodePartials, _live_splits, _merged_x, merge_args
from quant_serve.kernels.norm_act import silu_and_mul
from quant_serve.kernels.pdl import gl_pdl_start, gl_pdl_wait, launch_options, pdl_enabled
from quant_serve.kernels.matmul.frag.fold_tiles import FoldedNorm, _rms_normed, _write_residual
from quant_serve.kernels.matmul.frag.layout import FragWeights, pick_block_k
from quant_serve.kernels.matmul.frag.mma_steps import _mma_load, _mma_one, _ring_steps
from quant_serve.kernels.matmul.splitk import launch_splitk_reduce, split_buffers
from quant_serve.kernels.matmul.frag.tiles import _tile_words, mma_layout, swiglu_tile
from quant_serve.kernels.matmul.frag.wgmma import _cta_barrier, _wgmma_steps
_ROW1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
_QUADS: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

if hasattr(gl.shared_memory_descriptor, "reinterpret"):          # 3.9
    @gluon.jit
    def _x_rows(flat, X_STEPS: gl.constexpr, BLOCK_K: gl.constexpr):
        """The flat staged x [X_STEPS * BLOCK_K] as rows [X_STEPS, BLOCK_K] (row-major; index() takes a step)."""
        return flat.reinterpret(gl.float16, [X_STEPS, BLOCK_K], _ROW1)

    @gluon.jit
    def _x_quads(flat, QUADS: gl.constexpr):
        """The flat staged x [4 QUADS] as [QUADS, 4], row-major: where the attention merge stores it."""
        return flat.reinterpret(gl.float16, [QUADS, 4], _QUADS)
else:                                                           # 3.6
    @gluon.jit
    def _x_rows(flat, X_STEPS: gl.constexpr, BLOCK_K: gl.constexpr):
        """The flat staged x [X_STEPS * BLOCK_K] as rows [X_STEPS, BLOCK_K] (row-major; index() takes a step)."""
        return flat._reinterpret(gl.float16, [X_STEPS, BLOCK_K], _ROW1)

    @gluon.jit
    def _x_quads(flat, QUADS: gl.constexpr):
        """The flat staged x [4 QUADS] as [QUADS, 4], row-major: where the attention merge stores it."""
        return flat._reinterpret(gl.float16, [QUADS, 4], _QUADS)


@gluon.jit
def _w4a16_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, bias_ptr, r_ptr, ss_ptr, g_ptr, eps,
                      ss_count, ml_ptr, sl_ptr, vs_ptr, vs_val, M, N, K, KP, stride_xm,
                      stride_om, stride_sg, stride_zg, iters_per_split, n_splits, HAS_BIAS: gl.constexpr,
                      SPLIT: gl.constexpr, ONE_LAUNCH: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr,
                      EVEN_N: gl.constexpr, EVEN_K: gl.constexpr, X_SMEM: gl.constexpr, WGMMA: gl.constexpr,
                      PDL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                      num_warps: gl.constexpr, SCALE_AFTER: gl.constexpr, X_STEPS: gl.constexpr,
                      SWIGLU: gl.constexpr, A_SMEM: gl.constexpr, RESIDUAL: gl.constexpr = False,
                      NORM: gl.constexpr = False, SS_P2: gl.constexpr = 1, PRELOAD: gl.constexpr = False,
                      MERGE_SPLITS: gl.constexpr = 0, MERGE_D: gl.constexpr = 128, MERGE_TILE: gl.constexpr = 64,
                      MERGE_SCALE: gl.constexpr = 0, X_ONCE: gl.constexpr = True):
    """y = x @ W (+ bias) for one [BLOCK_M, BLOCK_N] output tile; with SPLIT, this split's fp32 partial goes to
    ws[pid_k] and is summed by the reduce pass or (ONE_LAUNCH) by the split that draws the last ticket.
    WGMMA (Hopper; BLOCK_N a multiple of 16 * num_warps, x through shared memory): _wgmma_steps.
    PDL (kernels/pdl.py): the first step's weights (two steps with wgmma) are requested before the previous kernel
    has finished; x, the workspace and the counters only after the wait. The next kernel is let in after the main
    loop: let in at the top, a matmul's successors launched ahead and competed with it for DRAM (entry 13 of
    the lab log, as did prefetching more steps into the L2).
    RESIDUAL (the decode step's RMSNorm folded into its neighbours, `w4a16_mma`): out = round(y) + r, rounded as
    torch's add, and ss[m, pid_n] = the tile's sum of out^2 (fp32). NORM (M = 1, x staged): x is such a sum's
    stream h; the staged x is RMSNorm(h) * g with the variance summed from ss[0, :ss_count]. MERGE_SPLITS (M = 1,
    x staged): x_ptr holds the decode kernel's split partials of one sequence (kernels/attention/merge.py: o at
    x_ptr, ml at ml_ptr, seq_lens at sl_ptr, MERGE_D the head size, MERGE_TILE its tile, the v scale by
    MERGE_SCALE), merged as x is staged."""
    MMA: gl.constexpr = mma_layout(WGMMA, num_warps, BLOCK_M)
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = gl.program_id(2) * BLOCK_M                   # row tiles of x (more than one only above BLOCK_M rows)
    offs, w_mask, n_lo, n_hi, k_in = _tile_words(pid_n, N, KP, GROUP, EVEN_N, BLOCK_N, BLOCK_K, num_warps, SWIGLU)

    if X_SMEM:
        # several rows: each thread loads 16 contiguous bytes of x (warps along M where the tile has the rows, so
        # no thread copies what another does), the tile goes through shared memory and comes back as the B
        # fragments (ldmatrix); the direct fragment loads would touch BLOCK_M lines per instruction
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1] if BLOCK_M >= 4 * num_warps else
                                            [1, num_warps], [1, 0])
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        m_mask = (offs_m < M)[:, None]
        k_row = offs_k[None, :]
    else:
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, B_L))
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, B_L))
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
        m_mask = (offs_m < M)[None, :]
        k_row = offs_k[:, None]

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    it0 = pid_k * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, KP // BLOCK_K)
    if WGMMA:
        acc = _wgmma_steps(acc, x_ptrs, m_mask, it0, it1, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                           stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, PDL, BLOCK_M, BLOCK_N, BLOCK_K,
                           A_L, A_SMEM)
    else:
        if X_STEPS > 0:
            x_flat = gl.allocate_shared_memory(gl.float16, [X_STEPS * BLOCK_K], _ROW1)
        # the weight loads of a step (words, scales, zero points; DRAM) are issued one step ahead of their use, so
        # the dequant and MMA of step i overlap the memory latency of step i + 1 (the last step loads itself again;
        # two steps ahead measured no faster: lab log entry 12); x (small, cache-resident) is staged
        # once (M = 1, 64 columns), copied two steps ahead (M > 1) or loaded at the top of its own step
        s_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        if SWIGLU:
            s_rows = swiglu_tile(pid_n, s_rows // 16, N, BLOCK_N) * 16 + s_rows % 16
        else:
            s_rows = pid_n * BLOCK_N + s_rows
        if not EVEN_N:
            s_rows = gl.minimum(s_rows, N - 1)
        cur = _mma_load(it0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg,
                        GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
        if PRELOAD:
            # a split of at most four steps (qkv and o at M = 1): all its weights are requested before the wait,
            # while the previous kernel finishes (batch-1 step -1.2%, lab log entry 23; the first
            # four of longer splits, down and gate_up, took registers enough to cost them their one wave: +4-6%)
            p1 = _mma_load(gl.minimum(it0 + 1, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                           s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
            p2 = _mma_load(gl.minimum(it0 + 2, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                           s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
            p3 = _mma_load(gl.minimum(it0 + 3, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                           s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
        if X_STEPS > 0:
            xk = gl.arange(0, X_STEPS * BLOCK_K, layout=gl.BlockedLayout([8], [32], [num_warps], [0]))
            x_mask = (xk < (it1 - it0) * BLOCK_K) & (it0 * BLOCK_K + xk < K)
            if NORM:
                gamma = gl.load(g_ptr + it0 * BLOCK_K + xk, mask=x_mask, other=0.0)     # a weight: before the wait
            if MERGE_SPLITS > 0:
                live = _live_splits(sl_ptr, MERGE_SPLITS, MERGE_TILE)       # the step's input: before the wait
        gl_pdl_wait(PDL)                      # x is the previous kernel's output
        if X_STEPS > 0:
            # M = 1: the split's x is staged once in shared memory (16-byte loads), so the steps read it there
            # instead of issuing their fragment loads behind the DRAM misses of the weight words
            if MERGE_SPLITS > 0:
                k_lo = it0 * BLOCK_K
                xq = _merged_x(x_ptr, ml_ptr, vs_ptr, vs_val, k_lo, gl.minimum((it1 - it0) * BLOCK_K, K - k_lo),
                               live, MERGE_SPLITS, MERGE_D, X_STEPS * BLOCK_K, MERGE_SCALE, num_warps)
                _x_quads(x_flat, X_STEPS * BLOCK_K // 4).store(xq.to(gl.float16))
            else:
                xv = gl.load(x_ptr + it0 * BLOCK_K + xk, mask=x_mask, other=0.0)
                if NORM:
                    xv = _rms_normed(xv, gamma, ss_ptr, ss_count, eps, K, SS_P2, num_warps)
                x_flat.store(xv)
            # one barrier here, or Triton's membar analysis puts one into every step of the loop (the store's
            # pending write joins the loop header; docs/kernels.md, "one x barrier");
            # X_ONCE False keeps the per-step one (mma_variant: long K)
            if X_ONCE:
                _cta_barrier()
            x_smem = _x_rows(x_flat, X_STEPS, BLOCK_K)
        if PRELOAD:
            # the whole split (at most four steps) came before the wait
            acc = _mma_one(acc, cur, x_ptrs, m_mask, k_row, x_smem, 0, it0 * BLOCK_K, K, n_lo, n_hi, ZP_MODE,
                           EVEN_K, X_SMEM, X_STEPS, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
            if it0 + 1 < it1:
                acc = _mma_one(acc, p1, x_ptrs, m_mask, k_row, x_smem, 1, (it0 + 1) * BLOCK_K, K, n_lo, n_hi,
                               ZP_MODE, EVEN_K, X_SMEM, X_STEPS, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
            if it0 + 2 < it1:
                acc = _mma_one(acc, p2, x_ptrs, m_mask, k_row, x_smem, 2, (it0 + 2) * BLOCK_K, K, n_lo, n_hi,
                               ZP_MODE, EVEN_K, X_SMEM, X_STEPS, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
            if it0 + 3 < it1:
                acc = _mma_one(acc, p3, x_ptrs, m_mask, k_row, x_smem, 3, (it0 + 3) * BLOCK_K, K, n_lo, n_hi,
                               ZP_MODE, EVEN_K, X_SMEM, X_STEPS, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        elif X_SMEM:                  # M > 1: x tiles by cp.async, two steps ahead (kernels/matmul/frag/mma_steps.py)
            acc = _ring_steps(acc, cur, x_ptrs, m_mask, k_row, K, it0, it1, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo,
                              n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, EVEN_K, SCALE_AFTER,
                              BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        else:
            for it in range(it0, it1):
                nxt = _mma_load(gl.minimum(it + 1, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                                s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
                acc = _mma_one(acc, cur, x_ptrs, m_mask, k_row, x_smem if X_STEPS > 0 else 0, it - it0,
                               it * BLOCK_K, K, n_lo, n_hi, ZP_MODE, EVEN_K, False, X_STEPS, SCALE_AFTER, BLOCK_M,
                               BLOCK_N, BLOCK_K, A_L, B_L)
                cur = nxt

    gl_pdl_start(PDL)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    tile = pid_n + gl.num_programs(0) * gl.program_id(2)
    mask = (om < M)[None, :] & (on < N)[:, None]
    offs_out = om[None, :] * N + on[:, None]                                      # [BLOCK_N, BLOCK_M]: y^T
    # the split-K protocol of kernels/matmul/splitk.py (_store_result, the Triton kernels' side): same workspace,
    # counters and split order, so both kinds of kernel share the reduce pass and the counter buffer
    if RESIDUAL:
        r = gl.load(r_ptr + offs_out, mask=mask, other=0.0)       # [BLOCK_N, BLOCK_M], before the ticket's wait
    else:
        r = 0
    if SPLIT:
        gl.store(ws_ptr + pid_k * M * N + offs_out, acc, mask=mask)
        if ONE_LAUNCH:
            # every thread's partial is stored before the ticket's release; the last split sums in split order
            _cta_barrier()
            ticket = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                total = gl.load(ws_ptr + offs_out, mask=mask, other=0.0, cache_modifier=".cg")
                for sp in range(1, n_splits):
                    total += gl.load(ws_ptr + sp * M * N + offs_out, mask=mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:                    # the tile's columns are paired, the workspace its scratch
                    _swiglu_out(total, out_ptr, pid_n, m0, M, stride_om, BLOCK_M, BLOCK_N, num_warps)
                elif RESIDUAL:
                    _write_residual(total, r, out_ptr, bias_ptr, ss_ptr, on, om, M, N, mask, stride_om, pid_n,
                                    gl.num_programs(0), HAS_BIAS)
                else:
                    _write_out(total, out_ptr, bias_ptr, on, om, N, mask, stride_om, HAS_BIAS)
                gl.store(cnt_ptr + tile, 0)
    elif SWIGLU:
        _swiglu_out(acc, out_ptr, pid_n, m0, M, stride_om, BLOCK_M, BLOCK_N, num_warps)
    elif RESIDUAL:
        _write_residual(acc, r, out_ptr, bias_ptr, ss_ptr, on, om, M, N, mask, stride_om, pid_n, gl.num_programs(0),
                        HAS_BIAS)
    else:
        _write_out(acc, out_ptr, bias_ptr, on, om, N, mask, stride_om, HAS_BIAS)


@gluon.jit
def _swiglu_out(acc, out_ptr, pid_n, m0, M, stride_om, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                num_warps: gl.constexpr):
    """acc fp32 [BLOCK_N, BLOCK_M]: gate rows, then the same columns' up rows (SWIGLU tiles) -> out[m, c] =
    silu(gate) * up for pid_n's BLOCK_N / 2 columns. The halves sit in different warps: through shared memory.
    Rounds as the matmul's fp16 output followed by silu_and_mul does (a GPU test compares bit for bit)."""
    H: gl.constexpr = BLOCK_N // 2
    OL: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    both = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    both.store(acc)
    gate = both.slice(0, H).load(OL).to(gl.float16).to(gl.float32)
    up = both.slice(H, H).load(OL).to(gl.float16).to(gl.float32)
    act = (gate / (1.0 + gl.exp(-gate))).to(gl.float16).to(gl.float32)
    cols = pid_n * H + gl.arange(0, H, layout=gl.SliceLayout(1, OL))
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OL))
    gl.store(out_ptr + rows[None, :] * stride_om + cols[:, None], (act * up).to(out_ptr.dtype.element_ty),
             mask=(rows < M)[None, :])


@gluon.jit
def _write_out(acc, out_ptr, bias_ptr, on, om, N, mask, stride_om, HAS_BIAS: gl.constexpr):
    """acc fp32 [BLOCK_N, BLOCK_M] (y^T) -> out[m, n] (+ bias) in out's dtype."""
    if HAS_BIAS:
        acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
    gl.store(out_ptr + om[None, :] * stride_om + on[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass
class MMAVariant:
    """How one w4a16_mma call runs: step rows, steps per split, splits, scales after the MMA, staged x rows, the
    wgmma A tile through shared memory, one CTA barrier after the x staging (else Triton's in every step)."""
    block_k: int
    per_split: int
    splits: int
    scale_after: bool
    x_steps: int
    a_smem: bool
    x_once: bool = True


def mma_variant(m: int, kp: int, group: int, block_n: int, block_k: int, split_k: int, wgmma: bool,
                scale_after: bool = True, x_staged: bool = True, a_smem: bool | None = None,
                x_once: bool | None = None) -> MMAVariant:
    """group 0: one group for all of K. Scales after the MMA: mma.sync, where each step lies inside one group
    (bench/results/exp-mma-variants-h200.json). x staged (M = 1): the split's rows in shared memory where they take at
    most 16 KB, with 64-column tiles only (the 128-column tile takes 120 registers with it, 4 programs an SM:
    slower, bench/results/exp-mma-xstaged-h200.json). wgmma's A tile through shared memory above 64 rows of x
    (bench/results/exp-mma-ss-h200.json; a_smem None: by that rule). x_once (None: by this rule): after the staging
    one CTA barrier, except on long K (Kp >= 8192, down): there the barrier Triton's membar pass puts into every step
    keeps ptxas from sinking the next step's weight loads below the step's MMAs, which it does without it (56
    registers instead of 65; the SASS test pins the order), and a split of down runs ten steps of those loads."""
    bk = pick_block_k(kp, group, block_k)
    iters = kp // bk
    per = triton.cdiv(iters, max(1, min(split_k, iters)))
    staged = x_staged and m == 1 and not wgmma and block_n == 64 and per * bk <= 8192
    return MMAVariant(bk, per, triton.cdiv(iters, per), scale_after and not wgmma and (not group or group % bk == 0),
                      triton.next_power_of_2(per) if staged else 0, wgmma and (m > 64 if a_smem is None else a_smem),
                      kp < 8192 if x_once is None else x_once)


def w4a16_mma(x: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None, block_n: int = 128,
              block_k: int = 256, split_k: int = 1, num_warps: int = 4, one_launch: bool = True,
              silu_mul: bool = False, wgmma: bool = False, scale_after: bool = True,
              x_staged: bool = True, a_smem: bool | None = None, residual: torch.Tensor | None = None,
              norm: FoldedNorm | None = None, max_regs: int = 0, preload: bool | None = None,
              x_once: bool | None = None):
    """x fp16 [M, K] (already permuted for act-order; M <= 64, any M with wgmma: 128-row tiles) -> [M, N], or
    [M, N/2] = silu(gate) * up. wgmma needs block_n % (16 * num_warps) == 0 with 4 or 8 warps (64 rows per
    warpgroup). scale_after (mma.sync, where a step lies inside one scale group): scales multiply each step's fp32
    partial, not each weight (faster at M = 1: docs/kernels.md, "scale_after").
    The decode step's RMSNorm folded into its neighbours (M = 1): residual [M, N] -> (h, ss): h = y + residual
    rounded as the unfused pair rounds, ss [M, tiles] fp32 its sums of squares by output tile; norm (x is such an h,
    x staged: M = 1 and 64-column tiles): the matmul of RMSNorm(x) * norm.weight. max_regs: ptxas's register cap
    a thread (kernels/matmul/rules.py:one_wave_regs; 0: none). preload (M = 1 with x staged, under PDL): a split of at
    most four steps requests all its weights before it waits for the previous kernel; by default (None) not where the
    scale group is shorter than a step (GGUF's 32, GPTQ g32): four steps' scales and zero points or offsets by
    16-row word then take the registers (qkv at M = 1, sm90, offline: 185 registers with offsets, 201 with zeros,
    against 78 and 94 without the preload and 72 for g128 with it; not yet timed). x_once: mma_variant's.
    x may be a batch-1 decode's split partials (kernels/attention/merge.DecodePartials, fp16 attention output):
    the attention merge is read by the x staging (M = 1, x staged, no norm)."""
    merge = x if isinstance(x, DecodePartials) else None
    if merge is not None:
        x = merge.out.view(merge.out.shape[0], -1)                  # [1, Hq D]: dtype and device, never read
        if merge.o.shape[0] != 1 or x.shape[1] != fw.in_features or x.dtype != torch.float16 or norm is not None:
            raise ValueError("split partials as x need one fp16 sequence whose Hq * head_dim is the layer's in "
                             "features (and no folded norm)")
    m, k = x.shape
    n = fw.out_features
    kp = fw.words.shape[1] // 2
    if (wgmma or m > 1) and (k != kp or x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16):
        # cp.async copies 16 aligned bytes per thread, which Triton proves only from a row stride divisible by 16
        # elements (its integer specialization): pad K to the packed length (zeros meet the pad rows' codes)
        x = torch.nn.functional.pad(x, (0, kp - k)).contiguous()     # pad keeps a transposed input's strides
        k = kp
    group = fw.group_size if fw.scales.shape[0] > 1 else 0           # 0: one group for all of K
    # float offsets and k-quant scales scale each weight (the fp16 fma of q * s + o): no scales after the MMA
    v = mma_variant(m, kp, group, block_n, block_k, split_k, wgmma, scale_after and fw.zp_mode < 2, x_staged,
                    a_smem, x_once)
    bk, per, splits = v.block_k, v.per_split, v.splits
    if merge is not None and v.x_steps == 0:
        raise ValueError("split partials as x need M = 1 with x staged (64-column tiles, no wgmma)")
    if norm is not None and (v.x_steps == 0 or norm.ss.shape[1] != triton.cdiv(k, norm.tile) or x.stride(0) != k):
        raise ValueError("a folded RMSNorm needs M = 1 with x staged (64-column tiles, no wgmma), a contiguous x "
                         "and the sums of squares of the layer that wrote it")
    if residual is not None and (silu_mul or wgmma or residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError("the residual epilogue needs an mma.sync matmul without SwiGLU and a contiguous [M, N] "
                         "residual")
    block_m = min(max(8, triton.next_power_of_2(m)), 128 if wgmma else 64)
    if m > block_m and not wgmma:
        raise ValueError(f"M = {m} is above the mma.sync kernel's 64 rows (wgmma tiles any M by 128 rows)")
    m_tiles = triton.cdiv(m, block_m)
    # the SwiGLU in the epilogue (one split, or the split that draws the last ticket), each program holding gate
    # and up of the same columns; otherwise the reduce pass applies it
    pairs = silu_mul and not wgmma and bias is None and block_n % 32 == 0 and (n // 2) % (block_n // 2) == 0
    one_launch = one_launch and splits > 1 and (pairs or not silu_mul)
    swiglu = pairs and (splits == 1 or one_launch)
    if residual is not None and splits > 1 and not one_launch:
        raise ValueError("the residual epilogue needs one launch (the reduce pass has none)")
    tiles = triton.cdiv(n, block_n)
    out, ws, cnt = split_buffers(x, m, n, splits, one_launch, tiles * m_tiles,
                                 n // 2 if silu_mul and (splits > 1 or swiglu) else 0)
    pdl = pdl_enabled(x)
    ss = torch.empty((m, tiles), dtype=torch.float32, device=x.device) if residual is not None else None
    ss_in = norm.ss if norm is not None else ss
    merge_ptrs, merge_consts = merge_args(merge) if merge is not None else ((out, out, out, 1.0), {})
    zeros, stride_zg = fw.zero_args()
    _w4a16_mma_kernel[(tiles, splits, m_tiles)](
        merge.o if merge is not None else x, fw.words, fw.scales, zeros, out, ws, cnt,
        bias if bias is not None else out, residual if residual is not None else out,
        ss_in if ss_in is not None else out, norm.weight if norm is not None else out,
        norm.eps if norm is not None else 0.0, ss_in.shape[1] if ss_in is not None else 0,
        *merge_ptrs, m, n, k, kp, x.stride(0), out.stride(0),
        fw.scales.stride(0), stride_zg, per, splits,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, ONE_LAUNCH=one_launch,
        GROUP=group or (1 << 30), ZP_MODE=fw.zp_mode, EVEN_N=n % block_n == 0, EVEN_K=k == kp,
        X_SMEM=m > 1 or wgmma, WGMMA=wgmma, PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        num_warps=num_warps, SCALE_AFTER=v.scale_after, X_STEPS=v.x_steps, SWIGLU=swiglu,
        A_SMEM=v.a_smem, RESIDUAL=residual is not None, NORM=norm is not None,
        SS_P2=triton.next_power_of_2(ss_in.shape[1]) if ss_in is not None else 1,
        PRELOAD=(preload if preload is not None else not group or group >= bk) and pdl and v.x_steps > 0 and per <= 4,
        X_ONCE=v.x_once,
        **launch_options(pdl),
        **merge_consts, **({"maxnreg": max_regs} if max_regs else {}))
    if splits > 1 and not one_launch:
        launch_splitk_reduce(ws, bias, out, splits, silu_mul)
    elif silu_mul and not swiglu:
        out = silu_and_mul(out)
    return (out, ss) if residual is not None else out
