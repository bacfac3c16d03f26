"""The mma.sync steps of the Gluon W4A16 matmul (kernels/w4a16_mma.py): a step's weight loads, its dequant + MMA,
and the M > 1 loop over x tiles copied into three shared buffers.

The M > 1 loop carries its load pointers from step to step (words, scales, zero points, x's next tile), each
bumped by a uniform offset, instead of computing them again from the step index, and runs its unrolled steps
unconditionally (the one or two left over after the loop). Offline sm90 SASS: 153 instructions a step at M = 16
and 135 at M = 8 (161 and 152 before), 78 and 72 registers (96 and 73).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kernels.w4a16_tiles import _dequant_step, _load_step
from kernels.w4a16_wgmma import _cta_barrier, _x_copy


@gluon.jit
def _mma_load(it, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg,
              GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr, SCALE_AFTER: gl.constexpr,
              BLOCK_K: gl.constexpr):
    """Step it's weight loads for the mma.sync loop; SCALE_AFTER: the step's scales in the accumulator's rows."""
    k0 = it * BLOCK_K
    if SCALE_AFTER:
        words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                                                   stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N, False)
        s_lo = gl.load(s_ptr + (k0 // GROUP) * stride_sg + s_rows)
    else:
        words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                                                   stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N)
    return words, s_lo, s_hi, z_lo, z_hi


@gluon.jit
def _mma_one(acc, p, x_ptrs, m_mask, k_row, x_smem, xi, k0, K, n_lo, n_hi, HAS_ZEROS: gl.constexpr,
             EVEN_K: gl.constexpr, X_SMEM: gl.constexpr, X_STEPS: gl.constexpr, SCALE_AFTER: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, A_L: gl.constexpr,
             B_L: gl.constexpr):
    """One mma.sync step: x's tile at k0 (cache-resident; X_STEPS: row xi of the split's x in shared memory;
    X_SMEM: x_smem holds the step's tile, copied ahead), the dequantized weights of p, acc += W^T x^T.
    SCALE_AFTER (the step inside one scale group): the MMA sums (q - z) x, exact products, and the step's
    partial is scaled per row in fp32: 4 fewer instructions per 8 weights than scaling each weight."""
    words, s_lo, s_hi, z_lo, z_hi = p
    if X_STEPS == 0 and not X_SMEM:
        if EVEN_K:
            xt = gl.load(x_ptrs + k0, mask=m_mask, other=0.0)
        else:
            xt = gl.load(x_ptrs + k0, mask=m_mask & (k_row + k0 < K), other=0.0)
    if SCALE_AFTER:
        a = _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, HAS_ZEROS, BLOCK_N, BLOCK_K, A_L, False)
    else:
        a = _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, HAS_ZEROS, BLOCK_N, BLOCK_K, A_L)
    if X_STEPS > 0:
        # one row of x: every column of the B fragment holds it (the extra output columns are never stored)
        xb = x_smem.index(xi).load(gl.SliceLayout(1, B_L))[:, None].broadcast_to([BLOCK_K, BLOCK_M])
    elif X_SMEM:
        xb = x_smem.permute((1, 0)).load(B_L)
    else:
        xb = xt
    if SCALE_AFTER:
        acc += mma_v2(a, xb, gl.zeros_like(acc)) * s_lo.to(gl.float32)[:, None]
    else:
        acc = mma_v2(a, xb, acc)
    return acc


@gluon.jit
def _step_ptrs(k0, w_ptr, s_ptr, z_ptr, offs, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP: gl.constexpr,
               HAS_ZEROS: gl.constexpr, SCALE_AFTER: gl.constexpr):
    """The pointers of the weight loads of the step at row k0 (_mma_load's): words, the scales of rows g and g + 8
    (SCALE_AFTER: of the accumulator's rows, then the second is unused), the zero words of rows g and g + 8."""
    grp = (k0 + k_in) // GROUP
    wp = w_ptr + offs + k0 * 2
    if SCALE_AFTER:
        slp = s_ptr + (k0 // GROUP) * stride_sg + s_rows
        shp = slp
    else:
        slp = s_ptr + grp * stride_sg + n_lo
        shp = s_ptr + grp * stride_sg + n_hi
    if HAS_ZEROS:
        zlp = z_ptr + grp * stride_zg + n_lo // 8
        zhp = z_ptr + grp * stride_zg + n_hi // 8
    else:
        zlp = z_ptr
        zhp = z_ptr
    return wp, slp, shp, zlp, zhp


@gluon.jit
def _load_at(q, w_mask, HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr, SCALE_AFTER: gl.constexpr):
    """The weight loads at pointers q (_step_ptrs) -> (words, s_lo, s_hi, z_lo, z_hi), as _mma_load returns them."""
    wp, slp, shp, zlp, zhp = q
    if EVEN_N:
        words = gl.load(wp)
    else:
        words = gl.load(wp, mask=w_mask, other=0)
    s_lo = gl.load(slp)
    if SCALE_AFTER:
        s_hi = 0
    else:
        s_hi = gl.load(shp)
    if HAS_ZEROS:
        z_lo = gl.load(zlp)
        z_hi = gl.load(zhp)
    else:
        z_lo = 0
        z_hi = 0
    return words, s_lo, s_hi, z_lo, z_hi


@gluon.jit
def _bump(q, dk, dg, stride_sg, stride_zg, HAS_ZEROS: gl.constexpr, SCALE_AFTER: gl.constexpr):
    """Pointers q moved on by dk rows of K and dg scale groups (both uniform)."""
    wp, slp, shp, zlp, zhp = q
    wp += dk * 2
    slp += dg * stride_sg
    if not SCALE_AFTER:
        shp += dg * stride_sg
    if HAS_ZEROS:
        zlp += dg * stride_zg
        zhp += dg * stride_zg
    return wp, slp, shp, zlp, zhp


@gluon.jit
def _ring_step(acc, p, q, xq, it, it1, x_use, x_fill, x_ptrs, m_mask, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi,
               k_in, s_rows, stride_sg, stride_zg, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr,
               EVEN_N: gl.constexpr, SCALE_AFTER: gl.constexpr, CARRY: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr):
    """Step it of the M > 1 loop with its weights p: the next step's weight loads issued (the last step loads itself
    again), x(it) in x_use (copied two steps ahead), the copy of x(it + 2) issued into x_fill (read by step it - 1),
    then the MMA -> (acc, the next step's weights, their pointers, where x(it + 3) is). CARRY: the weights of p
    were loaded at q and x(it + 2) is at xq; the pointers move on by a uniform offset. Otherwise both are computed
    from the clamped step index and the loads go before the barrier."""
    if not CARRY:
        nxt = _mma_load(gl.minimum(it + 1, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows,
                        stride_sg, stride_zg, GROUP, HAS_ZEROS, EVEN_N, SCALE_AFTER, BLOCK_K)
        xq = x_ptrs + gl.minimum(it + 2, it1 - 1) * BLOCK_K
    async_copy.wait_group(1)      # x(it) landed, x(it + 1) may still fly
    _cta_barrier()                # every thread's part of x(it); every thread done reading x(it - 1)
    if CARRY:
        # after the barrier: ptxas keeps them there (before it, they would go up a step, ahead of step it - 1's
        # MMAs: two steps of words in flight, 138 registers at M = 16 instead of 78)
        dk = gl.where(it + 1 < it1, BLOCK_K, 0)
        if GROUP <= BLOCK_K:
            dg = dk // GROUP
        else:
            dg = (it * BLOCK_K + dk) // GROUP - (it * BLOCK_K) // GROUP
        q = _bump(q, dk, dg, stride_sg, stride_zg, HAS_ZEROS, SCALE_AFTER)
        nxt = _load_at(q, w_mask, HAS_ZEROS, EVEN_N, SCALE_AFTER)
    _x_copy(x_fill, xq, m_mask)
    acc = _mma_one(acc, p, xq, m_mask, 0, x_use, 0, 0, 0, n_lo, n_hi, HAS_ZEROS, True, True, 0, SCALE_AFTER,
                   BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
    return acc, nxt, q, xq + gl.where(it + 3 < it1, BLOCK_K, 0)


@gluon.jit
def _ring_steps(acc, cur, q, x_ptrs, m_mask, it0, it1, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows,
                stride_sg, stride_zg, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr, EVEN_N: gl.constexpr,
                SCALE_AFTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                A_L: gl.constexpr, B_L: gl.constexpr):
    """The M > 1 loop over steps it0..it1 from step it0's weights cur (loaded by the caller before its PDL wait; at q,
    _step_ptrs, where BLOCK_M <= 32) -> acc. x's tiles go by cp.async into three buffers of their own, two steps
    ahead of their use, so that no step waits for its x behind the weight misses (x's rows 16-byte aligned, K the
    packed length: w4a16_mma pads). The loop is unrolled three times, so that Triton's membar analysis tells the
    buffer a copy fills from the one the step reads: one CTA barrier a step, not two (a ring of three indexed by
    step: gate_up at M = 2..16 3-4% slower, bench/results/exp-mma-bufs3-h200.json). Up to 32 rows the pointers are
    carried (_ring_step's CARRY) and the unrolled steps run unconditionally, the one or two left over after the
    loop, so that no step's registers merge with a skipped one's; at 64 rows (mma.sync on GPUs without wgmma) both
    would spill (136 bytes at 128 columns; none with the guarded steps and computed pointers)."""
    CARRY: gl.constexpr = BLOCK_M <= 32
    XS: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    x_buf0 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    x_buf1 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    x_buf2 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    xq = x_ptrs + it0 * BLOCK_K
    _x_copy(x_buf0, xq, m_mask)
    xq += gl.where(it0 + 1 < it1, BLOCK_K, 0)
    _x_copy(x_buf1, xq, m_mask)
    xq += gl.where(it0 + 2 < it1, BLOCK_K, 0)               # x(it0 + 2)'s tile, copied by step it0
    last = it0 + (it1 - it0) // 3 * 3 if CARRY else it1
    for it in range(it0, last, 3):
        acc, cur, q, xq = _ring_step(acc, cur, q, xq, it, it1, x_buf0, x_buf2, x_ptrs, m_mask, w_ptr, s_ptr, z_ptr,
                                     offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP, HAS_ZEROS,
                                     EVEN_N, SCALE_AFTER, CARRY, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        if CARRY or it + 1 < it1:
            acc, cur, q, xq = _ring_step(acc, cur, q, xq, it + 1, it1, x_buf1, x_buf0, x_ptrs, m_mask, w_ptr, s_ptr,
                                         z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP,
                                         HAS_ZEROS, EVEN_N, SCALE_AFTER, CARRY, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        if CARRY or it + 2 < it1:
            acc, cur, q, xq = _ring_step(acc, cur, q, xq, it + 2, it1, x_buf2, x_buf1, x_ptrs, m_mask, w_ptr, s_ptr,
                                         z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP,
                                         HAS_ZEROS, EVEN_N, SCALE_AFTER, CARRY, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
    if CARRY:                   # the one or two steps left over
        if last < it1:
            acc, cur, q, xq = _ring_step(acc, cur, q, xq, last, it1, x_buf0, x_buf2, x_ptrs, m_mask, w_ptr, s_ptr,
                                         z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP,
                                         HAS_ZEROS, EVEN_N, SCALE_AFTER, CARRY, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        if last + 1 < it1:
            acc, cur, q, xq = _ring_step(acc, cur, q, xq, last + 1, it1, x_buf1, x_buf0, x_ptrs, m_mask, w_ptr, s_ptr,
                                         z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP,
                                         HAS_ZEROS, EVEN_N, SCALE_AFTER, CARRY, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
    async_copy.wait_group(0)
    return acc
