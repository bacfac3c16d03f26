"""Triton kernels of the integer KV cache (format: kernels/attention/kv_int.py): quantize-on-write and paged
attention that dequantizes each K/V tile in registers (codes x group scale (+ zero point)) as it loads it, never a
dequantized copy of the cache.

Both follow the torch twin exactly where it matters: the store computes the group's scale in fp32, rounds it (and
the zero point) to fp16, and rounds codes by floor(x / scale + 0.5) with an IEEE division, so kernel and twin
write the same codes. The attention kernel is the prefill kernel's structure (kernels/attention/triton_kernels.py:
causal, varlen, GQA rows of one kv head); a decode batch runs it with one query token a program (BLOCK_Q = 1).
With an exact window (RING > 0, kernels/attention/kv_exact.py) the tiles that reach into some query's window also
load the exact K/V (this step's new tokens, the sequence's ring) and take each score and value from the exact or
the dequantized tile by the window rule; the tiles before every window run as without one.
"""
from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.attention.kv_int_tiles import _attend_codes, _codes_tile
from quant_serve.kernels.attention.triton_kernels import NEG, _attend_tile, _online_softmax, _query_rows


@triton.jit
def _quantize_groups(x, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                     ZP: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 -> (codes [BLOCK_H, BLOCK_D] int32, as stored: int8 -127..127, int4 nibbles
    0..15; scale, zero [BLOCK_H, NG] fp32, already fp16-exact)."""
    NG: tl.constexpr = BLOCK_D // GROUP
    QMAX: tl.constexpr = 127.0 if BITS == 8 else (15.0 if ZP else 7.0)
    xg = tl.reshape(x, (BLOCK_H, NG, GROUP))
    if ZP:
        zero = tl.min(xg, axis=2).to(tl.float16).to(tl.float32)
        scale = tl.math.div_rn(tl.max(xg, axis=2) - zero, QMAX + tl.zeros_like(zero))
    else:
        zero = tl.zeros([BLOCK_H, NG], tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(xg), axis=2), QMAX + tl.zeros_like(zero))
    scale = scale.to(tl.float16).to(tl.float32)
    scale = tl.where(scale > 0, scale, 1.0)
    q = tl.floor(tl.math.div_rn(xg - zero[:, :, None], scale[:, :, None] + tl.zeros_like(xg)) + 0.5)
    if ZP:
        q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    else:
        q = tl.minimum(tl.maximum(q, -QMAX - (BITS == 4)), QMAX)
        if BITS == 4:
            q = q + 8.0
    return tl.reshape(q, (BLOCK_H, BLOCK_D)).to(tl.int32), scale, zero


@triton.jit
def _int_store_rows(x, codes_ptr, scales_ptr, slot, offs_h, h_mask, stride_cb, stride_cs, stride_ch, stride_sb,
                    stride_ss, stride_sh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    GROUP: tl.constexpr, BITS: tl.constexpr, ZP: tl.constexpr):
    """One token's K (or V) x [BLOCK_H, BLOCK_D] fp32 quantized into cache slot `slot` (codes and scales)."""
    NG: tl.constexpr = BLOCK_D // GROUP
    S: tl.constexpr = 2 if ZP else 1
    offs_d = tl.arange(0, BLOCK_D)
    q, scale, zero = _quantize_groups(x, BLOCK_H, BLOCK_D, GROUP, BITS, ZP)
    blk = slot // BLOCK_SIZE
    pos = slot % BLOCK_SIZE
    c_rows = codes_ptr + blk * stride_cb + pos * stride_cs + offs_h[:, None] * stride_ch
    if BITS == 8:
        tl.store(c_rows + offs_d[None, :], q.to(tl.int8), mask=h_mask[:, None])
    else:       # element 2i in the low nibble, 2i + 1 in the high one
        pairs = tl.reshape(q, (BLOCK_H, BLOCK_D // 2, 2))
        weight = (1 + 15 * tl.arange(0, 2))[None, None, :]
        offs_b = tl.arange(0, BLOCK_D // 2)
        tl.store(c_rows + offs_b[None, :], tl.sum(pairs * weight, axis=2).to(tl.uint8), mask=h_mask[:, None])
    offs_g = tl.arange(0, NG)
    s_rows = scales_ptr + blk * stride_sb + pos * stride_ss + offs_h[:, None] * stride_sh + offs_g[None, :] * S
    tl.store(s_rows, scale.to(tl.float16), mask=h_mask[:, None])
    if ZP:
        tl.store(s_rows + 1, zero.to(tl.float16), mask=h_mask[:, None])


@triton.jit
def _int_store_kernel(x_ptr, codes_ptr, scales_ptr, slot_ptr, H, stride_xt, stride_xh,
                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      GROUP: tl.constexpr, BITS: tl.constexpr, ZP: tl.constexpr):
    """Grid (T,): token t's K (or V) [H, D] quantized into slot_mapping[t] (-1: skipped). head_dim = BLOCK_D."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < H
        x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=h_mask[:, None],
                    other=0.0).to(tl.float32)
        _int_store_rows(x, codes_ptr, scales_ptr, slot, offs_h, h_mask, stride_cb, stride_cs, stride_ch, stride_sb,
                        stride_ss, stride_sh, BLOCK_H, BLOCK_D, BLOCK_SIZE, GROUP, BITS, ZP)


@triton.jit
def _int_tile(codes_ptr, scales_ptr, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, stride_sb,
              stride_ss, stride_sh, offs_d, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
              ZP: tl.constexpr):
    """Tokens `toks` of one sequence, kv head h, dequantized: [BLOCK_N, BLOCK_D] fp32 (0 where masked)."""
    S: tl.constexpr = 2 if ZP else 1
    blk = tl.load(table_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    pos = toks % BLOCK_SIZE
    m = tok_mask[:, None]
    c_off = (blk * stride_cb + pos * stride_cs + h * stride_ch)[:, None]
    if BITS == 8:
        q = tl.load(codes_ptr + c_off + offs_d[None, :], mask=m, other=0).to(tl.float32)
    else:
        byte = tl.load(codes_ptr + c_off + (offs_d // 2)[None, :], mask=m, other=0).to(tl.int32)
        q = ((byte >> ((offs_d % 2) * 4)[None, :]) & 15).to(tl.float32)
        if not ZP:
            q = q - 8.0
    s_off = (blk * stride_sb + pos * stride_ss + h * stride_sh)[:, None] + ((offs_d // GROUP) * S)[None, :]
    x = q * tl.load(scales_ptr + s_off, mask=m, other=0.0).to(tl.float32)
    if ZP:
        x += tl.load(scales_ptr + s_off + 1, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit
def _exact_tile(new_ptr, ring_ptr, toks, is_new, in_ring, new_row0, ring_row, h, stride_nt, stride_nh, stride_rs,
                stride_rh, offs_d, RING: tl.constexpr):
    """Exact K (or V) of tokens `toks`, kv head h: [BLOCK_N, BLOCK_D] fp32 (0 where neither new nor in the ring)."""
    x = tl.load(new_ptr + ((new_row0 + toks) * stride_nt + h * stride_nh)[:, None] + offs_d[None, :],
                mask=is_new[:, None], other=0.0).to(tl.float32)
    x += tl.load(ring_ptr + ((ring_row * RING + toks % RING) * stride_rs + h * stride_rh)[:, None] + offs_d[None, :],
                 mask=in_ring[:, None], other=0.0).to(tl.float32)
    return x


@triton.jit
def _attend_tile_exact(q, k, v, ke, ve, use, s_mask, m_i, l_i, acc, qk_scale, SOFTCAP: tl.constexpr):
    """_attend_tile where each (query, key) of `use` [R, N] takes the exact ke / ve instead of k / v."""
    s = tl.where(use, tl.dot(q, tl.trans(ke)), tl.dot(q, tl.trans(k)))
    p, alpha, m_new, l_i = _online_softmax(s, s_mask, m_i, l_i, qk_scale, SOFTCAP)
    acc = acc * alpha[:, None] + tl.dot(tl.where(use, 0.0, p).to(v.dtype), v) \
        + tl.dot(tl.where(use, p, 0.0).to(ve.dtype), ve)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "stride_tb", "window"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "qsl_ptr"])
def _int_attention_kernel(q_ptr, k_codes, v_codes, k_scales, v_scales, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                          qk_scale, num_seqs, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                          stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                          new_k, new_v, ring_k, ring_v, ring_row_ptr, ring_lo_ptr, ring_hi_ptr,
                          stride_nt, stride_nh, stride_rs, stride_rh, part_o, part_ml, Hq,
                          G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
                          BITS: tl.constexpr, ZP: tl.constexpr, SOFTCAP: tl.constexpr, RING: tl.constexpr,
                          SPLITS: tl.constexpr):
    """Grid (T // BLOCK_Q + B, Hkv, SPLITS): BLOCK_Q new tokens of one sequence x its G query heads against its
    paged, quantized context, causal (as _prefill_kernel; head_dim = BLOCK_D). RING > 0: the exact window's size.
    SPLITS > 1 (decode only): program axis 2 takes one of SPLITS whole-tile parts of the context and stores its
    unnormalized partial softmax (part_o [B, Hq, SPLITS, D], part_ml: max and sum, exp2 domain) for
    kernels/attention/merge.py's merge, as the fp16 / fp8 decode kernel does."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    h = tl.program_id(1)
    b, q_start, q_len, qb, seq_len, ctx, qi, g, row_mask = _query_rows(qsl_ptr, seq_lens_ptr, num_seqs, G, GP,
                                                                       BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)                                            # [BLOCK_M, BLOCK_D]
    q_pos = ctx + qi
    kv_end = tl.where(qb * BLOCK_Q < q_len, tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_Q), 0)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + b * stride_tb
    kv_start = tl.where(window > 0, tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0), 0)
    plain_end = kv_end
    if RING > 0:    # tiles from here on reach into the first query's window
        first_exact = ctx + qb * BLOCK_Q - RING + 1
        plain_end = tl.minimum(kv_end, kv_start + tl.maximum(first_exact - kv_start, 0) // BLOCK_N * BLOCK_N)
    split_lo = kv_start
    split_hi = kv_end
    if SPLITS > 1:  # this program's whole tiles of [kv_start, kv_end)
        per_split = tl.cdiv(tl.cdiv(tl.maximum(kv_end - kv_start, 0), BLOCK_N), SPLITS) * BLOCK_N
        split_lo = kv_start + tl.program_id(2) * per_split
        split_hi = tl.minimum(kv_end, split_lo + per_split)
    q_sum = tl.sum(q.to(tl.float32), axis=1)          # for the zero points of the codes path
    for n0 in range(split_lo, tl.minimum(plain_end, split_hi), BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < kv_end
        causal = (toks[None, :] <= q_pos[:, None]) & tok_mask[None, :]
        causal = causal & ((toks[None, :] > q_pos[:, None] - window) | (window <= 0))
        if GROUP == BLOCK_D:        # one scale per token and head: attend on the codes (kv_int_tiles.py)
            ck, k_s, k_z = _codes_tile(k_codes, k_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs,
                                       stride_ch, stride_sb, stride_ss, stride_sh, q.dtype, BLOCK_N, BLOCK_D,
                                       BLOCK_SIZE, BITS, ZP)
            cv, v_s, v_z = _codes_tile(v_codes, v_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs,
                                       stride_ch, stride_sb, stride_ss, stride_sh, q.dtype, BLOCK_N, BLOCK_D,
                                       BLOCK_SIZE, BITS, ZP)
            m_i, l_i, acc = _attend_codes(q, q_sum, ck, k_s, k_z, cv, v_s, v_z, causal, m_i, l_i, acc, qk_scale,
                                          SOFTCAP, ZP)
        else:
            k = _int_tile(k_codes, k_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch,
                          stride_sb, stride_ss, stride_sh, offs_d, BLOCK_SIZE, GROUP, BITS, ZP).to(q.dtype)
            v = _int_tile(v_codes, v_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch,
                          stride_sb, stride_ss, stride_sh, offs_d, BLOCK_SIZE, GROUP, BITS, ZP).to(q.dtype)
            m_i, l_i, acc = _attend_tile(q, k, v, causal, m_i, l_i, acc, qk_scale, SOFTCAP)
    if RING > 0:
        ring_row = tl.load(ring_row_ptr + b).to(tl.int64)
        ring_lo = tl.load(ring_lo_ptr + b)
        ring_hi = tl.load(ring_hi_ptr + b)
        for n0 in tl.range(tl.maximum(plain_end, split_lo), split_hi, BLOCK_N, num_stages=1):   # a tile or two
            toks = n0 + tl.arange(0, BLOCK_N)
            tok_mask = toks < kv_end
            k = _int_tile(k_codes, k_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch,
                          stride_sb, stride_ss, stride_sh, offs_d, BLOCK_SIZE, GROUP, BITS, ZP).to(q.dtype)
            v = _int_tile(v_codes, v_scales, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch,
                          stride_sb, stride_ss, stride_sh, offs_d, BLOCK_SIZE, GROUP, BITS, ZP).to(q.dtype)
            is_new = tok_mask & (toks >= ctx)
            in_ring = tok_mask & (toks >= ring_lo) & (toks < ring_hi) & (toks < ctx)
            ke = _exact_tile(new_k, ring_k, toks, is_new, in_ring, q_start - ctx, ring_row, h, stride_nt,
                             stride_nh, stride_rs, stride_rh, offs_d, RING).to(q.dtype)
            ve = _exact_tile(new_v, ring_v, toks, is_new, in_ring, q_start - ctx, ring_row, h, stride_nt,
                             stride_nh, stride_rs, stride_rh, offs_d, RING).to(q.dtype)
            use = (is_new | in_ring)[None, :] & (toks[None, :] > q_pos[:, None] - RING)
            causal = (toks[None, :] <= q_pos[:, None]) & tok_mask[None, :]
            causal = causal & ((toks[None, :] > q_pos[:, None] - window) | (window <= 0))
            m_i, l_i, acc = _attend_tile_exact(q, k, v, ke, ve, use, causal, m_i, l_i, acc, qk_scale, SOFTCAP)
    if SPLITS > 1:
        part = (b * Hq + h * G + g) * SPLITS + tl.program_id(2)                                     # [BLOCK_M]
        tl.store(part_o + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml + part * 2, m_i, mask=row_mask)
        tl.store(part_ml + part * 2 + 1, l_i, mask=row_mask)
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
