"""Gluon W4A8 matmul over the fragment layout (kernels/matmul/frag/layout.py): int8 x int8 mma.sync m16n8k32, int32 sums
per weight group, scaled into an fp32 accumulator (sm80+; the card plans of sm80 / 86 / 89, sm90 under them).

y^T = W^T x^T as in the W4A16 kernel: the weight tile [BLOCK_N, BLOCK_K] is the A operand in registers, straight
from the words, x_q^T the B operand (cp.async into three shared buffers, ldmatrix). A fragment word of lane 4g + t
holds nibble j = 4 b0 + 2 b2 + b1 = the code of row g + 8 b1, k = 2t + b0 + 8 b2: `w & 0x0F0F0F0F` is four int8
of row g and `(w >> 4) & 0x0F0F0F0F` the same four k of row g + 8, which is an m16n8k32 A register (four k a byte)
once x_q's K is stored in that order inside each 16 channels (kernels/matmul/int8/quant.py writes it so). Two words of
consecutive 16-row tiles are one k32 fragment. The zero point is subtracted in the register (bytes 0x80 + q - z,
then the top bit flipped: q - z as int8, 3 instructions a register), so the MMA sums x_q (q - z) exactly in int32.
Each K step lies inside one weight group: its int32 tile is converted (adding 1.5 * 2^23 to the bits: exact below
2^22, an IADD and an FADD instead of the quarter-rate I2F) and added as acc += float(sums) * s_w[n] * s_x[m]; with
one activation scale a row ("token") s_x multiplies once at the end.
"""
import torch

from quant_serve.kernels.triton_compat import async_copy, gl, gluon, mma_v2, triton
from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_NONE, FragWeights
from quant_serve.kernels.matmul.frag.tiles import _load_step
from quant_serve.kernels.matmul.splitk import launch_splitk_reduce
from quant_serve.kernels.matmul.frag.wgmma import _cp_async, _cta_barrier
from quant_serve.kernels.matmul.int8.quant import quantize_act
from quant_serve.kernels.matmul.int8.tiles import _a8_tile, _a8_tile_words, _zc

_F32_MAGIC = gl.constexpr(12582912.0)        # 1.5 * 2^23: the bits of int32 s + 0x4B400000 are this float + s
_I32_MAGIC = gl.constexpr(0x4B400000)


@gluon.jit
def _a8_load(it, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg, stride_zg,
             GROUP: gl.constexpr, ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Step it's weight loads: words, packed zero words of rows g and g + 8, the scales in the accumulator's rows."""
    k0 = it * BLOCK_K
    words, s_lo, s_hi, z_lo, z_hi = _load_step(k0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, 0, stride_sg,
                                               stride_zg, GROUP, ZP_MODE, EVEN_N, False)
    s_w = gl.load(s_ptr + (k0 // GROUP) * stride_sg + s_rows)
    return words, z_lo, z_hi, s_w


@gluon.jit
def _a8_copy(x_buf, s_buf, x_ptrs, m_mask, sx_ptrs, sm_mask, it, GROUP: gl.constexpr, ACT_TOKEN: gl.constexpr,
             BLOCK_K: gl.constexpr):
    """cp.async of step it's x_q tile (and, per group, its rows' activation scales) into one buffer set."""
    _cp_async(x_buf, x_ptrs + it * BLOCK_K, mask=m_mask)
    if not ACT_TOKEN:
        _cp_async(s_buf, sx_ptrs + (it * BLOCK_K) // GROUP, mask=sm_mask)
    async_copy.commit_group()


@gluon.jit
def _a8_step(acc, p, nxt_it, it1, x_use, s_use, x_fill, s_fill, x_ptrs, m_mask, sx_ptrs, sm_mask, w_ptr, s_ptr,
             z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg, stride_zg, GROUP: gl.constexpr,
             ZP_MODE: gl.constexpr, EVEN_N: gl.constexpr, ACT_TOKEN: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, MMA: gl.constexpr):
    """One K step: the next step's weights requested, x(it) waited for, x(it + 2) copied into the buffers step
    it - 1 read, the A tile formed and multiplied with x(it), the int32 sums scaled into acc. -> (acc, next)."""
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    nxt = _a8_load(gl.minimum(nxt_it, it1 - 1), w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg,
                   stride_zg, GROUP, ZP_MODE, EVEN_N, BLOCK_K)
    async_copy.wait_group(1)          # x(it) landed, x(it + 1) may still fly
    _cta_barrier()                    # every thread's part of x(it); every thread done with step it - 1's buffers
    _a8_copy(x_fill, s_fill, x_ptrs, m_mask, sx_ptrs, sm_mask, gl.minimum(nxt_it + 1, it1 - 1), GROUP, ACT_TOKEN,
             BLOCK_K)
    words, z_lo, z_hi, s_w = p
    a = _a8_tile(words, _zc(z_lo, n_lo, words, ZP_MODE), _zc(z_hi, n_hi, words, ZP_MODE), BLOCK_N, BLOCK_K, A_L)
    xb = x_use.permute((1, 0)).load(B_L)
    sums = mma_v2(a, xb, gl.zeros([BLOCK_N, BLOCK_M], gl.int32, MMA))
    f = (sums + _I32_MAGIC).to(gl.float32, bitcast=True) - _F32_MAGIC
    if ACT_TOKEN:
        acc += f * s_w.to(gl.float32)[:, None]
    else:
        acc += f * (s_w.to(gl.float32)[:, None] * s_use.load(gl.SliceLayout(0, MMA))[None, :])
    return acc, nxt


@gluon.jit(do_not_specialize=["M", "iters_per_split"])
def _w4a8_mma_kernel(xq_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, bias_ptr, M, N, KP, stride_xm,
                     stride_sxm, stride_om, stride_sg, stride_zg, iters_per_split, HAS_BIAS: gl.constexpr,
                     SPLIT: gl.constexpr, GROUP: gl.constexpr, ZP_MODE: gl.constexpr, ACT_TOKEN: gl.constexpr,
                     EVEN_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     num_warps: gl.constexpr, WARPS_M: gl.constexpr = 1):
    """y = dequant(x_q) @ W (+ bias) for one [BLOCK_M, BLOCK_N] output tile over this program's K split (SPLIT: the
    fp32 partial to ws[pid_k], summed by the reduce pass). Every BLOCK_K step lies inside one weight group
    (GROUP % BLOCK_K == 0; GROUP 2^30: one group). Warps: num_warps / WARPS_M along the weight rows (16 rows each at
    least), WARPS_M along the x rows (each reads its share of the x tile from shared memory, all of them the A tile)."""
    WARPS_N: gl.constexpr = num_warps // WARPS_M
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS_N, WARPS_M],
                                                  instr_shape=[16, 8])
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = gl.program_id(2) * BLOCK_M
    offs, w_mask, n_lo, n_hi = _a8_tile_words(pid_n, N, KP, EVEN_N, BLOCK_N, BLOCK_K, WARPS_N, WARPS_M)
    # x_q tiles: 16 bytes a thread along K, rows past M copied as zeros
    TK: gl.constexpr = BLOCK_K // 16
    XL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TK, TK], [num_warps, 1], [1, 0])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    x_ptrs = xq_ptr + offs_m[:, None] * stride_xm + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, XL))[None, :]
    m_mask = (offs_m < M)[:, None]
    SL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    sm = m0 + gl.arange(0, BLOCK_M, layout=SL)
    sx_ptrs = sx_ptr + sm * stride_sxm
    sm_mask = sm < M
    s_rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    if not EVEN_N:
        s_rows = gl.minimum(s_rows, N - 1)

    PHASE: gl.constexpr = 1 if BLOCK_K >= 128 else 128 // BLOCK_K          # 128-byte rows a swizzle phase
    XS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=PHASE, max_phase=8 // PHASE, order=[1, 0])
    S1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    x_buf0 = gl.allocate_shared_memory(gl.int8, [BLOCK_M, BLOCK_K], XS)
    x_buf1 = gl.allocate_shared_memory(gl.int8, [BLOCK_M, BLOCK_K], XS)
    x_buf2 = gl.allocate_shared_memory(gl.int8, [BLOCK_M, BLOCK_K], XS)
    s_buf0 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], S1)
    s_buf1 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], S1)
    s_buf2 = gl.allocate_shared_memory(gl.float32, [BLOCK_M], S1)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    it0 = pid_k * iters_per_split
    it1 = gl.minimum(it0 + iters_per_split, KP // BLOCK_K)
    cur = _a8_load(it0, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg, stride_zg, GROUP,
                   ZP_MODE, EVEN_N, BLOCK_K)
    _a8_copy(x_buf0, s_buf0, x_ptrs, m_mask, sx_ptrs, sm_mask, it0, GROUP, ACT_TOKEN, BLOCK_K)
    _a8_copy(x_buf1, s_buf1, x_ptrs, m_mask, sx_ptrs, sm_mask, gl.minimum(it0 + 1, it1 - 1), GROUP, ACT_TOKEN,
             BLOCK_K)
    # unrolled by three so that Triton's membar pass tells the buffers apart: one CTA barrier a step
    for it in range(it0, it1, 3):
        acc, cur = _a8_step(acc, cur, it + 1, it1, x_buf0, s_buf0, x_buf2, s_buf2, x_ptrs, m_mask, sx_ptrs, sm_mask,
                            w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg, stride_zg, GROUP,
                            ZP_MODE, EVEN_N, ACT_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, MMA)
        if it + 1 < it1:
            acc, cur = _a8_step(acc, cur, it + 2, it1, x_buf1, s_buf1, x_buf0, s_buf0, x_ptrs, m_mask, sx_ptrs,
                                sm_mask, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg,
                                stride_zg, GROUP, ZP_MODE, EVEN_N, ACT_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, MMA)
        if it + 2 < it1:
            acc, cur = _a8_step(acc, cur, it + 3, it1, x_buf2, s_buf2, x_buf1, s_buf1, x_ptrs, m_mask, sx_ptrs,
                                sm_mask, w_ptr, s_ptr, z_ptr, offs, w_mask, n_lo, n_hi, s_rows, stride_sg,
                                stride_zg, GROUP, ZP_MODE, EVEN_N, ACT_TOKEN, BLOCK_M, BLOCK_N, BLOCK_K, MMA)
    async_copy.wait_group(0)

    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    if ACT_TOKEN:
        acc = acc * gl.load(sx_ptr + om * stride_sxm, mask=om < M, other=0.0)[None, :]
    mask = (om < M)[None, :] & (on < N)[:, None]
    if SPLIT:
        gl.store(ws_ptr + pid_k * M * N + om[None, :] * N + on[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + on, mask=on < N, other=0.0).to(gl.float32)[:, None]
        # y^T's columns are y's rows: through shared memory, so a warp's stores run along n (16 bytes a thread)
        TN: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8
        OL: gl.constexpr = gl.BlockedLayout([8, 1], [TN, 32 // TN], [1, num_warps], [0, 1])
        y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OL)
        yn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OL))
        ym = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OL))
        gl.store(out_ptr + ym[None, :] * stride_om + yn[:, None], y, mask=(ym < M)[None, :] & (yn < N)[:, None])


def w4a8_block_k(kp: int, group: int) -> int:
    """Step rows: 128 where the steps line up with the weight groups (group 0: one group), else 64 (groups of 64)."""
    for bk in (128, 64):
        if kp % bk == 0 and (not group or group % bk == 0):
            return bk
    raise ValueError(f"the W4A8 kernel needs groups that are a multiple of 64 rows, got {group}")


def w4a8_mma(xq: torch.Tensor, sx: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float16, block_m: int = 128, block_n: int = 128, split_k: int = 1,
             num_warps: int = 8, act_token: bool = False, warps_m: int = 1) -> torch.Tensor:
    """x_q int8 [M, Kp] (fragment K order, kernels/matmul/int8/quant.py) and s_x fp32 [M, blocks] -> y [M, N] in out_dtype.
    act_token: one activation scale a row (s_x [M, 1]); else one a row and weight group. fw: INT4 zero points or
    symmetric. block_n = 16 * (num_warps / warps_m) * a power of two, block_m a multiple of 8 * warps_m; split_k: K
    splits (two launches)."""
    m, kp = xq.shape
    n = fw.out_features
    if fw.zp_mode not in (ZP_NONE, ZP_INT4) or kp != fw.words.shape[1] // 2:
        raise ValueError("the W4A8 kernel takes INT4 weights with integer zero points (or symmetric) and x_q of "
                         "the words' packed length")
    group = fw.group_size if fw.scales.shape[0] > 1 else 0
    bk = w4a8_block_k(kp, group)
    iters = kp // bk
    per = triton.cdiv(iters, max(1, min(split_k, iters)))
    splits = triton.cdiv(iters, per)
    m_tiles = triton.cdiv(m, block_m)
    tiles = triton.cdiv(n, block_n)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=xq.device) if splits > 1 else out
    zeros, stride_zg = fw.zero_args()
    _w4a8_mma_kernel[(tiles, splits, m_tiles)](
        xq, sx, fw.words, fw.scales, zeros, out, ws, bias if bias is not None else out, m, n, kp, xq.stride(0),
        sx.stride(0), out.stride(0), fw.scales.stride(0), stride_zg, per,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, GROUP=group or (1 << 30), ZP_MODE=fw.zp_mode,
        ACT_TOKEN=act_token, EVEN_N=n % block_n == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
        num_warps=num_warps, WARPS_M=warps_m)
    if splits > 1:
        launch_splitk_reduce(ws, bias, out, splits)
    return out


def w4a8_forward(x: torch.Tensor, fw: FragWeights, bias: torch.Tensor | None = None, act_scale: str = "group",
                 block_m: int = 128, block_n: int = 128, split_k: int = 1, num_warps: int = 8,
                 warps_m: int = 1) -> torch.Tensor:
    """x [M, K] fp16 / bf16 (already permuted for act-order) -> y [M, N] in x's dtype: x quantized per row
    ("token") or per row and weight group ("group"), then w4a8_mma."""
    kp = fw.words.shape[1] // 2
    token = act_scale == "token" or fw.scales.shape[0] == 1
    xq, sx = quantize_act(x, kp, x.shape[1] if token else fw.group_size)
    return w4a8_mma(xq, sx, fw, bias, x.dtype, block_m, block_n, split_k, num_warps, token, warps_m)
