"""An integer cache's attention prologue and epilogue as Triton kernels (CUDA): neox RoPE on q and k, the rotation
of q, k and v (kernels/attention/kv_int.hadamard), and the quantizing store of k and v, one launch for a step's
tokens; and the output's rotation back, one launch. Before, each layer ran these as about 30 small torch ops (RoPE
in fp32 pieces, each rotation a cast, a matmul and a cast): the torch twins, engine/worker/attention._int_forward's
CPU path, which these match up to summation order (RoPE and each rotation rounded to the activations' dtype in
turn, the rotation's products in fp32).
"""
import torch

from quant_serve.kernels.attention.kv_int import format_of
from quant_serve.kernels.attention.kv_int_kernels import _int_store_rows
from quant_serve.kernels.triton_compat import tl, triton


@triton.jit
def _rope_rows(x_rows, offs_i, mask, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Neox RoPE of one token's heads (x_rows [BLOCK_H, 1] row pointers) -> [BLOCK_H, 2 * HALF] fp32, rounded to
    x's dtype as the twin's apply_rope_ref returns it."""
    x1 = tl.load(x_rows + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + HALF + offs_i[None, :], mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_rows.dtype.element_ty).to(tl.float32)
    y2 = (x2 * cos + x1 * sin).to(x_rows.dtype.element_ty).to(tl.float32)
    return tl.reshape(tl.permute(tl.join(y1, y2), (0, 2, 1)), (BLOCK_H, 2 * HALF))


@triton.jit
def _rotated(x, offs_d, dtype, D: tl.constexpr, LOG2_D: tl.constexpr, ROTATE: tl.constexpr):
    """x [BLOCK_H, D] fp32 (values of dtype) -> x @ H rounded to dtype, as fp32 (ROTATE False: x). H is the
    Sylvester-Hadamard matrix kv_int.hadamard builds, H[i, j] = (-1)^popcount(i & j) / sqrt(D): its signs are made
    here, exact in dtype, the tensor cores sum the exact products in fp32 and the 1 / sqrt(D) comes after."""
    if ROTATE:
        bits = offs_d[:, None] & offs_d[None, :]
        parity = tl.zeros([D, D], tl.int32)
        for b in tl.static_range(LOG2_D):
            parity = parity ^ ((bits >> b) & 1)
        signs = (1 - 2 * parity).to(dtype)
        x = (tl.dot(x.to(dtype), signs, out_dtype=tl.float32) * (1.0 / tl.sqrt(D * 1.0))).to(dtype).to(tl.float32)
    return x


@triton.jit
def _int_prologue_kernel(q_ptr, k_ptr, v_ptr, q_out, k_out, v_out, pos_ptr, cos_sin_ptr, slot_ptr,
                         k_codes, v_codes, k_scales, v_scales, HQ, HKV,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_oqt, stride_oqh,
                         stride_okt, stride_okh, stride_pos,
                         stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                         BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, D: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, ZP: tl.constexpr,
                         LOG2_D: tl.constexpr, ROTATE: tl.constexpr):
    """Grid (T, 2): program (t, 0) ropes and rotates token t's q heads into q_out; (t, 1) its k (roped) and v
    (ROTATE: rotated; else v is left where it is) heads into k_out / v_out and, where slot_mapping[t] >= 0, quantizes
    both into the cache. Outputs have unit stride along D; k_out and v_out share strides. An output may be its input:
    each program writes only the rows it has read."""
    HALF: tl.constexpr = D // 2
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF)
    offs_d = tl.arange(0, D)
    cos = tl.load(cos_sin_ptr + pos * stride_pos + offs_i).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_pos + HALF + offs_i).to(tl.float32)[None, :]
    dtype = q_ptr.dtype.element_ty
    if tl.program_id(1) == 0:         # (names differ by branch: Triton wants each name one shape across both)
        offs_hq = tl.arange(0, BLOCK_HQ)
        hq_mask = offs_hq < HQ
        q = _rope_rows(q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh, offs_i, hq_mask[:, None], cos, sin,
                       HALF, BLOCK_HQ)
        q = _rotated(q, offs_d, dtype, D, LOG2_D, ROTATE)
        tl.store(q_out + t * stride_oqt + offs_hq[:, None] * stride_oqh + offs_d[None, :], q.to(dtype),
                 mask=hq_mask[:, None])
    else:
        offs_hk = tl.arange(0, BLOCK_HKV)
        hk_mask = offs_hk < HKV
        k = _rope_rows(k_ptr + t * stride_kt + offs_hk[:, None] * stride_kh, offs_i, hk_mask[:, None], cos, sin,
                       HALF, BLOCK_HKV)
        k = _rotated(k, offs_d, dtype, D, LOG2_D, ROTATE)
        v = tl.load(v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=hk_mask[:, None],
                    other=0.0).to(tl.float32)
        v = _rotated(v, offs_d, dtype, D, LOG2_D, ROTATE)
        out_rows = t * stride_okt + offs_hk[:, None] * stride_okh + offs_d[None, :]
        tl.store(k_out + out_rows, k.to(dtype), mask=hk_mask[:, None])
        if ROTATE:
            tl.store(v_out + out_rows, v.to(dtype), mask=hk_mask[:, None])
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            _int_store_rows(k, k_codes, k_scales, slot, offs_hk, hk_mask, stride_cb, stride_cs, stride_ch, stride_sb,
                            stride_ss, stride_sh, BLOCK_HKV, D, BLOCK_SIZE, GROUP, BITS, ZP)
            _int_store_rows(v, v_codes, v_scales, slot, offs_hk, hk_mask, stride_cb, stride_cs, stride_ch, stride_sb,
                            stride_ss, stride_sh, BLOCK_HKV, D, BLOCK_SIZE, GROUP, BITS, ZP)


@triton.jit
def _rotate_kernel(x_ptr, out_ptr, H, stride_xt, stride_xh, BLOCK_H: tl.constexpr, D: tl.constexpr,
                   LOG2_D: tl.constexpr):
    """Grid (T,): out[t] = x[t] @ H over its heads (the Hadamard rotation, see _rotated), in out's dtype."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    h_mask = offs_h < H
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=h_mask[:, None],
                other=0.0).to(tl.float32)
    y = _rotated(x, offs_d, out_ptr.dtype.element_ty, D, LOG2_D, True)
    tl.store(out_ptr + t * H * D + offs_h[:, None] * D + offs_d[None, :], y, mask=h_mask[:, None])


def _heads_block(h: int) -> int:
    return max(16, 1 << max(0, h - 1).bit_length())       # tl.dot needs 16 rows


def fits(q: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Whether the prologue kernel takes this layer: CUDA, full rotary, head_dim a power of two >= 16."""
    d = q.shape[-1]
    return q.is_cuda and cos_sin_cache.shape[1] == d and d >= 16 and d & (d - 1) == 0 \
        and q.stride(-1) == 1 and cos_sin_cache.stride(1) == 1


def int_prologue_triton(q, k, v, positions, cos_sin_cache, rotate: bool, k_cache, v_cache, slot_mapping, k_scales,
                        v_scales, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k / v [T, Hkv, D] before RoPE -> (q, k, v): q and k roped, all three rotated by
    kv_int.hadamard(D) where `rotate`, whose signs the kernel makes itself (not rotated: v is returned as it came);
    k and v quantized into the cache at slot_mapping (-1: skipped). out: the (q, k, v) to write, which may be the
    inputs (in place); default new contiguous tensors."""
    num_tokens, num_q_heads, d = q.shape
    num_kv_heads = k.shape[1]
    fmt = format_of(k_cache, k_scales)
    if out is None:
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v) if rotate else v)
    q_out, k_out, v_out = out
    if not rotate:
        v_out = v
    if num_tokens == 0:
        return q_out, k_out, v_out
    if min(k.stride(2), v.stride(2), q_out.stride(2), k_out.stride(2)) != 1 or (rotate and k_out.stride() !=
                                                                                v_out.stride()):
        raise ValueError("int_prologue_triton needs unit stride along head_dim, and k / v outputs of one layout")
    _int_prologue_kernel[(num_tokens, 2)](
        q, k, v, q_out, k_out, v_out, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, k_scales,
        v_scales, num_q_heads, num_kv_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scales.stride(0), k_scales.stride(1),
        k_scales.stride(2),
        BLOCK_HQ=_heads_block(num_q_heads), BLOCK_HKV=_heads_block(num_kv_heads), D=d, BLOCK_SIZE=k_cache.shape[1],
        GROUP=fmt.group, BITS=fmt.bits, ZP=fmt.zero_point, LOG2_D=d.bit_length() - 1, ROTATE=rotate, num_warps=4)
    return q_out, k_out, v_out


def rotate_triton(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (unit stride along D) -> x @ kv_int.hadamard(D), a new contiguous tensor in x's dtype."""
    num_tokens, heads, d = x.shape
    out = torch.empty(num_tokens, heads, d, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotate_kernel[(num_tokens,)](x, out, heads, x.stride(0), x.stride(1), BLOCK_H=_heads_block(heads), D=d,
                                      LOG2_D=d.bit_length() - 1, num_warps=4)
    return out
