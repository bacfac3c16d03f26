"""Triton KV-cache writes: `store_kv` and the fused `rope_store_kv` (neox RoPE on q and k in place, then store).

One program per token; slot_mapping[t] = -1 skips the store. fp8 caches get clamp(x / scale) rounded to nearest
even, like the torch twin (kernels/attention/reference.py); an e4m3 cache viewed as bytes (a GPU without fp8 conversion)
gets the same bits from attention_triton._f32_to_e4m3. The cos_sin_cache layout is documented there.
"""
from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.attention.triton_kernels import _quantize, _to_cache
from quant_serve.kernels.pdl import pdl_start, pdl_wait


@triton.jit
def _store_token(cache_ptr, slot, x, offs_h, offs_d, mask, stride_cb, stride_cs, stride_ch,
                 BLOCK_SIZE: tl.constexpr):
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    tl.store(cache_ptr + dst + offs_h[:, None] * stride_ch + offs_d[None, :], _to_cache(x, cache_ptr), mask=mask)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache, v_cache, slot_ptr, k_scale_ptr, v_scale_ptr, k_scale_val,
                     v_scale_val, H, D, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMAX: tl.constexpr,
                     IS_FP8: tl.constexpr, SCALE_PTR: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < H)[:, None] & (offs_d < D)[None, :]
        k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask).to(tl.float32)
        v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                    mask=mask).to(tl.float32)
        k = _quantize(k, k_scale_ptr, k_scale_val, FMAX, IS_FP8, SCALE_PTR)
        v = _quantize(v, v_scale_ptr, v_scale_val, FMAX, IS_FP8, SCALE_PTR)
        _store_token(k_cache, slot, k, offs_h, offs_d, mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        _store_token(v_cache, slot, v, offs_h, offs_d, mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)


@triton.jit
def _rotate(x_rows, offs_i, mask, cos, sin, HALF: tl.constexpr):
    """Neox RoPE in place of one token's heads (x_rows: [H, 1] row pointers); returns the rotated halves rounded
    to x's dtype, as fp32 (what the torch twin stores)."""
    x1 = tl.load(x_rows + offs_i[None, :], mask=mask).to(tl.float32)
    x2 = tl.load(x_rows + HALF + offs_i[None, :], mask=mask).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_rows.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_rows.dtype.element_ty)
    tl.store(x_rows + offs_i[None, :], y1, mask=mask)
    tl.store(x_rows + HALF + offs_i[None, :], y2, mask=mask)
    return y1.to(tl.float32), y2.to(tl.float32)


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache, v_cache, slot_ptr,
                          k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, HQ, HKV,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pos,
                          stride_cb, stride_cs, stride_ch,
                          BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMAX: tl.constexpr,
                          IS_FP8: tl.constexpr, SCALE_PTR: tl.constexpr, PDL: tl.constexpr):
    """Grid (T, 2): program (t, 0) rotates token t's q heads in place, (t, 1) rotates its k heads and stores k
    and v by slot (two short dependent chains side by side instead of one long one)."""
    pdl_start(PDL)
    pdl_wait(PDL)                     # q, k, v are the previous kernel's output (kernels/pdl.py)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_pos + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_pos + HALF + offs_i, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    if tl.program_id(1) == 0:
        offs_hq = tl.arange(0, BLOCK_HQ)
        q_rows = q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh
        _rotate(q_rows, offs_i, (offs_hq < HQ)[:, None] & i_mask[None, :], cos, sin, HALF)
    else:
        offs_hk = tl.arange(0, BLOCK_HKV)
        k_mask = (offs_hk < HKV)[:, None] & i_mask[None, :]
        k1, k2 = _rotate(k_ptr + t * stride_kt + offs_hk[:, None] * stride_kh, offs_i, k_mask, cos, sin, HALF)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            v_rows = v_ptr + t * stride_vt + offs_hk[:, None] * stride_vh
            v1 = tl.load(v_rows + offs_i[None, :], mask=k_mask).to(tl.float32)
            v2 = tl.load(v_rows + HALF + offs_i[None, :], mask=k_mask).to(tl.float32)
            k1 = _quantize(k1, k_scale_ptr, k_scale_val, FMAX, IS_FP8, SCALE_PTR)
            k2 = _quantize(k2, k_scale_ptr, k_scale_val, FMAX, IS_FP8, SCALE_PTR)
            v1 = _quantize(v1, v_scale_ptr, v_scale_val, FMAX, IS_FP8, SCALE_PTR)
            v2 = _quantize(v2, v_scale_ptr, v_scale_val, FMAX, IS_FP8, SCALE_PTR)
            _store_token(k_cache, slot, k1, offs_hk, offs_i, k_mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            _store_token(k_cache + HALF, slot, k2, offs_hk, offs_i, k_mask, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE)
            _store_token(v_cache, slot, v1, offs_hk, offs_i, k_mask, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
            _store_token(v_cache + HALF, slot, v2, offs_hk, offs_i, k_mask, stride_cb, stride_cs, stride_ch,
                         BLOCK_SIZE)
