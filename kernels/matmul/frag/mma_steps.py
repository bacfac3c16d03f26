"""The mma.sync steps of the Gluon W4A16 matmul (kernels/matmul/frag/mma.py): a step's weight loads, its dequant + MMA,
and the M > 1 loop over x tiles copied into three shared buffers.

Measured and not kept (docs/kernels.md, "carried load pointers"): the M > 1 loop with its load pointers carried
from step to step and its unrolled steps unconditional: fewer instructions and registers, but its weight loads had
to go after the step's barrier, and it ran slower at M = 2..16.
"""
from quant_serve.kernels.triton_compat import gl, gluon, async_copy, mma_v2
from quant_serve.kernels.matmul.frag.tiles import _dequant_step, _load_step
from quant_serve.kernels.matmul.frag.wgmma import _cta_barrier, _x_copy


@gluon.jit
def _mma_load(it, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg,
              GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr, SCALE_AFTER: gl.constexpr,
              BLOCK_K: gl.constexpr):
    """Step it's weight loads for the mma.sync loop; SCALE_AFTER: the step's scales in the accumulator's rows."""
    k0 = it * BLOCK_K
    if SCALE_AFTER:
        words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                                                   stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, False)
        s_lo = gl.load(s_ptr + (k0 // GROUP) * stride_sg + s_rows)
    else:
        words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                                                   stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N)
    return words, s_lo, s_hi, z_lo, z_hi


@gluon.jit
def _mma_one(acc, p, x_ptrs, m_mask, k_row, x_smem, xi, k0, K, n_lo, n_hi, ZP_MODE: gl.constexpr,
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
        a = _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L, False)
    else:
        a = _dequant_step(words, s_lo, s_hi, z_lo, z_hi, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L)
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
def _buf_step(acc, p, it, it0, it1, x_use, x_fill, x_ptrs, m_mask, k_row, K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo,
              n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP: gl.constexpr, ZP_MODE: gl.constexpr,
              EVEN_N: gl.constexpr, EVEN_K: gl.constexpr, SCALE_AFTER: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr):
    """Step it of the M > 1 loop over three x buffers with its weights p: the next step's weight loads issued,
    x(it) in x_use (copied two steps ahead), the copy of x(it + 2) issued into x_fill (read by step it - 1), then
    _mma_one. -> (acc, the next step's weights)."""
    nxt = _mma_load(gl.minimum(it + 1, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows,
                    stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N, SCALE_AFTER, BLOCK_K)
    async_copy.wait_group(1)      # x(it) landed, x(it + 1) may still fly
    _cta_barrier()                # every thread's part of x(it); every thread done reading x(it - 1)
    _x_copy(x_fill, x_ptrs + gl.minimum(it + 2, it1 - 1) * BLOCK_K, m_mask)
    acc = _mma_one(acc, p, x_ptrs, m_mask, k_row, x_use, it - it0, it * BLOCK_K, K, n_lo, n_hi, ZP_MODE, EVEN_K,
                   True, 0, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
    return acc, nxt


@gluon.jit
def _ring_steps(acc, cur, x_ptrs, m_mask, k_row, K, it0, it1, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                s_rows, stride_sg, stride_zg, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr,
                EVEN_K: gl.constexpr, SCALE_AFTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, A_L: gl.constexpr, B_L: gl.constexpr):
    """The M > 1 loop over steps it0..it1 from step it0's weights cur (requested by the caller before its PDL wait)
    -> acc. x's tiles go by cp.async into three buffers of their own, two steps ahead of their use, so that no step
    waits for its x behind the weight misses (x's rows 16-byte aligned, K the packed length: w4a16_mma pads). The
    loop is unrolled three times, so that Triton's membar analysis tells the buffer a copy fills from the one the
    step reads: one CTA barrier a step, not two (a ring of three indexed by step: gate_up at M = 2..16 3-4%
    slower, bench/results/exp-mma-bufs3-h200.json)."""
    XS: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    x_buf0 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    x_buf1 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    x_buf2 = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_K], XS)
    _x_copy(x_buf0, x_ptrs + it0 * BLOCK_K, m_mask)
    _x_copy(x_buf1, x_ptrs + gl.minimum(it0 + 1, it1 - 1) * BLOCK_K, m_mask)
    for it in range(it0, it1, 3):
        acc, cur = _buf_step(acc, cur, it, it0, it1, x_buf0, x_buf2, x_ptrs, m_mask, k_row, K, w_ptr, s_ptr, z_ptr,
                             offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N,
                             EVEN_K, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        if it + 1 < it1:
            acc, cur = _buf_step(acc, cur, it + 1, it0, it1, x_buf1, x_buf0, x_ptrs, m_mask, k_row, K, w_ptr, s_ptr,
                                 z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP, ZP_MODE,
                                 EVEN_N, EVEN_K, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
        if it + 2 < it1:
            acc, cur = _buf_step(acc, cur, it + 2, it0, it1, x_buf2, x_buf1, x_ptrs, m_mask, k_row, K, w_ptr, s_ptr,
                                 z_ptr, offs, w_mask, n_lo, n_hi, k_in, s_rows, stride_sg, stride_zg, GROUP, ZP_MODE,
                                 EVEN_N, EVEN_K, SCALE_AFTER, BLOCK_M, BLOCK_N, BLOCK_K, A_L, B_L)
    async_copy.wait_group(0)
    return acc
