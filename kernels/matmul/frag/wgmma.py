"""The Hopper (sm90) main loops of the Gluon W4A16 matmul (kernels/matmul/frag/mma.py): wgmma over the dequantized
weight tile (A) and x^T (B, cp.async into shared memory), and the cp.async copy of x tiles both kernels' loops use.
"""
from quant_serve.kernels.triton_compat import (gl, gluon, async_copy, fence_async_shared, warpgroup_mma,
                                               warpgroup_mma_wait)
from quant_serve.kernels.pdl import gl_pdl_wait
from quant_serve.kernels.matmul.frag.tiles import _dequant_step, _load_step

# names across Triton releases (Gluon is experimental): 3.6 thread_barrier / async_copy_global_to_shared,
# 3.9 barrier / async_load
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared


@gluon.jit
def _x_copy(dst, x_ptrs, m_mask):
    """cp.async of x's [BLOCK_M, BLOCK_K] tile at x_ptrs into shared memory (rows past M: 0)."""
    _cp_async(dst, x_ptrs, mask=m_mask)
    async_copy.commit_group()


@gluon.jit
def _wgmma_steps(acc, x_ptrs, m_mask, it0, it1, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, stride_sg,
                 stride_zg, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr,
                 PDL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 A_L: gl.constexpr, A_SMEM: gl.constexpr):
    """The Hopper main loop over steps it0..it1 -> acc; x's rows are 16-byte aligned and K is the packed length
    (w4a16_mma pads x otherwise). Step i + 1's raw weight loads fly during step i.
    A in registers: wgmma(step i) is issued, step i + 1 is dequantized and its x tile copied, then the wait. ptxas
    places the wait right after the issue (the next step's dequant defines registers a wgmma of the loop reads),
    so dequant and MMA overlap only across programs. x^T by cp.async into a double buffer: the copy of step i + 1
    targets the buffer of step i - 1, whose wgmma that step's wait retired.
    A_SMEM (above 64 rows of x): the dequantized tile through a shared double buffer, so wgmma(i) runs during
    step i + 1's dequant (each warpgroup writes and reads only its own 64 rows: its own wait(1) frees its half);
    x^T in a triple buffer (x(i + 1) is copied while the other warpgroup's wgmma(i - 1) may still read x(i - 1)).
    64 KB of shared memory and the stores: faster at M = 128, slower at M <= 64 (docs/kernels.md, "A_SMEM")."""
    p0 = _load_step(it0 * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in, stride_sg, stride_zg, GROUP,
                    ZP_MODE, EVEN_N)
    p1 = _load_step(gl.minimum(it0 + 1, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, k_in,
                    stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N)
    if A_SMEM:
        x_smem = gl.allocate_shared_memory(gl.float16, [3, BLOCK_M, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float16))
        a_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK_N, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float16))
        a_smem.index(0).store(_dequant_step(*p0, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L))
        gl_pdl_wait(PDL)                      # x is the previous kernel's output
        _x_copy(x_smem.index(0), x_ptrs + it0 * BLOCK_K, m_mask)
        for it in range(it0, it1):
            i = it - it0
            async_copy.wait_group(0)
            fence_async_shared()              # this thread's A(i) stores, before the async proxy reads them
            _cta_barrier()                    # every thread's x(i) and A(i) landed; every wgmma(i - 2) retired
            acc = warpgroup_mma(a_smem.index(i % 2), x_smem.index(i % 3).permute((1, 0)), acc, is_async=True)
            _x_copy(x_smem.index((i + 1) % 3), x_ptrs + gl.minimum(it + 1, it1 - 1) * BLOCK_K, m_mask)
            a = _dequant_step(*p1, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L)
            p1 = _load_step(gl.minimum(it + 2, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi,
                            k_in, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])  # wgmma(i - 1) retired: A buffer (i + 1) % 2
            a_smem.index((i + 1) % 2).store(a)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    else:
        x_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.float16))
        gl_pdl_wait(PDL)
        _x_copy(x_smem.index(it0 % 2), x_ptrs + it0 * BLOCK_K, m_mask)
        a = _dequant_step(*p0, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L)
        for it in range(it0, it1):
            async_copy.wait_group(0)
            _cta_barrier()                    # every thread's part of x(it) landed; every wgmma(it - 1) retired
            fence_async_shared()
            acc = warpgroup_mma(a, x_smem.index(it % 2).permute((1, 0)), acc, is_async=True)
            nxt = gl.minimum(it + 1, it1 - 1)  # the last step repeats itself (no read past this split)
            _x_copy(x_smem.index((it + 1) % 2), x_ptrs + nxt * BLOCK_K, m_mask)
            a = _dequant_step(*p1, n_lo, n_hi, ZP_MODE, BLOCK_N, BLOCK_K, A_L)
            p1 = _load_step(gl.minimum(it + 2, it1 - 1) * BLOCK_K, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi,
                            k_in, stride_sg, stride_zg, GROUP, ZP_MODE, EVEN_N)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)
    return acc
