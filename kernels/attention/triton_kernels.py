"""Triton paged attention over the KV cache [num_blocks, BLOCK_SIZE, Hkv, D] (fp16/bf16/fp32 or fp8 e4m3/e5m2).

GQA: a program owns one kv head and all G = Hq/Hkv query heads that share it, so every K/V tile is read once per
group. fp8 values are widened to the query dtype exactly; the per-layer scales are folded into the softmax scale
(k) and the output (v) instead of multiplying every element. Softmax runs in the exp2 domain.
Two per-model options (off by default): `window` > 0 (a sliding-window layer) hides keys more than window - 1
positions behind the query; SOFTCAP > 0 (Gemma 2) caps scores at +-SOFTCAP by a tanh, SOFTCAP given in the exp2
domain (the cap times log2(e)), as the scores are.
"""
from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.pdl import pdl_start, pdl_wait

NEG = tl.constexpr(-1.0e30)   # finite "minus infinity": fully masked rows stay NaN-free


@triton.jit
def _scale(ptr, value, FROM_PTR: tl.constexpr):
    if FROM_PTR:
        return tl.load(ptr).to(tl.float32)
    return value


@triton.jit
def _quantize(x, scale_ptr, scale_val, FMAX: tl.constexpr, IS_FP8: tl.constexpr, SCALE_PTR: tl.constexpr):
    """fp32 values -> what the cache stores, still fp32 (the caller casts)."""
    if IS_FP8:
        x = tl.math.div_rn(x, _scale(scale_ptr, scale_val, SCALE_PTR))
        x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    return x


@triton.jit
def _e4m3_to_f16(bits):
    """e4m3fn bit patterns (uint8: a cache viewed as bytes on a GPU without fp8 conversions, sm80 / sm86) -> fp16,
    exactly: the 7 value bits moved into fp16's exponent and mantissa fields give the value / 2^8 (subnormals too),
    the sign moves to bit 15."""
    b = bits.to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _f32_to_e4m3(x):
    """fp32 values within +-448 -> e4m3fn bit patterns (uint8), rounded to nearest even as cvt.rn and torch do.
    Normal range: the fp32 mantissa rounded to 3 bits (a carry moves into the exponent), the exponent rebiased
    127 -> 7; below 2^-6: multiples of 2^-9, rounded to nearest even by adding 2^23 (one fp32 rounding)."""
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    ab = a.to(tl.uint32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _to_cache(x, cache_ptr):
    """fp32 values (already scaled and clamped for fp8) -> what the cache holds: its dtype, or e4m3 bit patterns
    where the cache is viewed as bytes (no fp8 conversion on the GPU)."""
    if cache_ptr.dtype.element_ty == tl.uint8:
        return _f32_to_e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_tile(cache_ptr, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
             BLOCK_SIZE: tl.constexpr):
    """Gather tokens `toks` of one sequence, kv head h: [BLOCK_N, BLOCK_D] in the cache dtype (0 where masked)."""
    blk = tl.load(table_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    off = blk * stride_cb + (toks % BLOCK_SIZE) * stride_cs + h * stride_ch
    return tl.load(cache_ptr + off[:, None] + offs_d[None, :], mask=tok_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _widen(x, dtype: tl.constexpr, CVT: tl.constexpr):
    """A K/V tile in the query dtype. CVT (fp8 cache, fp16 queries, on the GPU): cvt.rn.f16x2 in inline asm, four
    values from one 32-bit register, in the layout the tile was loaded in. Left to Triton, the 1-byte tile takes
    the layout change to the MMA operand first (through shared memory, ~100 narrow loads a 64-token tile) and is
    widened after."""
    if x.dtype == tl.uint8:            # e4m3 bytes: no fp8 conversion on this GPU (CVT is off there)
        return _e4m3_to_f16(x).to(dtype)
    if CVT:
        src: tl.constexpr = "e5m2x2" if x.dtype == tl.float8e5 else "e4m3x2"
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2." + src + " $0, lo; cvt.rn.f16x2." + src +
            " $1, hi; }", "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(dtype)


@triton.jit
def _softcap(s, SOFTCAP: tl.constexpr):
    """SOFTCAP * tanh(s / SOFTCAP) with tanh(x) = 1 - 2 / (e^2x + 1) (saturates cleanly at +-inf)."""
    if SOFTCAP > 0:
        s = SOFTCAP * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 / SOFTCAP) * 1.4426950408889634) + 1.0))
    return s


@triton.jit
def _online_softmax(s, s_mask, m_i, l_i, qk_scale, SOFTCAP: tl.constexpr):
    """The softmax half of one online-softmax step: raw scores s [R, N] -> (p [R, N], alpha [R] to rescale the
    accumulator by, the new max, the new sum), exp2 domain (qk_scale holds log2(e))."""
    s = tl.where(s_mask, _softcap(s * qk_scale, SOFTCAP), NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, SOFTCAP: tl.constexpr):
    """One online-softmax step. q [R, D], k/v [N, D] in q's dtype, s_mask [R, N]."""
    p, alpha, m_new, l_i = _online_softmax(tl.dot(q, tl.trans(k)), s_mask, m_i, l_i, qk_scale, SOFTCAP)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_tb", "window"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "qsl_ptr", "pos_ptr", "slot_ptr"])
def _decode_kernel(q_ptr, k_cache, v_cache, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr, part_o, part_ml,
                   k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, qk_scale, D, window,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_cb, stride_cs, stride_ch,
                   k_new_ptr, v_new_ptr, pos_ptr, cos_sin_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_pos, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, IS_FP8: tl.constexpr,
                   SCALE_PTR: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr, FMAX: tl.constexpr,
                   FP8_CVT: tl.constexpr, EARLY_TILE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Grid (B, Hkv, splits): one query token per sequence. The split length follows this sequence's own length
    (whole BLOCK_N tiles), not the table width the grid was sized for, so a short context in a CUDA graph captured
    for long ones still spreads over programs; splits past the end store an empty partial (merged by
    _decode_reduce_kernel: a merge by the last split to finish, ticket as in the matmul, made the batch-1 step
    slower: docs/kernels.md, "decode reduce").
    ROPE (the decode step's RoPE + KV store folded in, one launch less per layer): q, k and v are the new tokens
    before RoPE; every program rotates q in registers, and the split holding the new token (position
    seq_len - 1) rotates its k, stores k and v by slot (-1: not stored) and attends to them from registers, as
    stored (fp8: quantized), instead of reading them back from the cache.
    window > 0: tokens before lo = seq_len - window are skipped (the splits still cut [0, seq_len): a split below
    lo stores an empty partial, which the merges weigh 0)."""
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    # before the wait: the step's inputs (written before the previous kernel started, kernels/pdl.py), with ROPE
    # the RoPE row, and with EARLY_TILE (needs ROPE: the cache up to the new token, which earlier steps wrote) the
    # first K/V tile, so the block-table -> K/V round trips overlap the previous kernel's tail
    seq_len = tl.load(seq_lens_ptr + b)
    q_idx = tl.load(qsl_ptr + b)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = sp * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if ROPE:
        end = tl.minimum(end, seq_len - 1)        # the new token is attended from registers
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    table_row = tables_ptr + b * stride_tb
    toks0 = start + tl.arange(0, BLOCK_N)
    mask0 = (toks0 < end) & (toks0 >= lo)
    if EARLY_TILE:
        k0 = _kv_tile(k_cache, table_row, toks0, mask0, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                      BLOCK_SIZE)
        v0 = _kv_tile(v_cache, table_row, toks0, mask0, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                      BLOCK_SIZE)
    if ROPE:
        cos, sin, slot = _rope_row(q_idx, pos_ptr, cos_sin_ptr, slot_ptr, stride_pos, offs_d, BLOCK_D)
    pdl_wait(PDL)                     # q (and the new k, v) are the previous kernel's output
    rows = tl.arange(0, GP)
    row_mask = rows < G
    heads = h * G + rows
    q_rows = q_ptr + q_idx * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [GP, BLOCK_D]
    if IS_FP8:
        qk_scale = qk_scale * _scale(k_scale_ptr, k_scale_val, SCALE_PTR)
    m_i = tl.full([GP], NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    if ROPE:
        q, m_i, l_i, acc = _new_token(q, q_rows, m_i, l_i, acc, q_idx, h, seq_len, start, start + tokens_per_split,
                                      cos, sin, slot, k_new_ptr, v_new_ptr, k_cache, v_cache, k_scale_ptr,
                                      v_scale_ptr, k_scale_val, v_scale_val, qk_scale, stride_kt, stride_kh,
                                      stride_vt, stride_vh, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                                      row_mask, BLOCK_D, BLOCK_SIZE, FMAX, IS_FP8, SCALE_PTR, SOFTCAP)
    first = start
    if EARLY_TILE:
        if tl.maximum(start, lo) < end:           # a fully masked tile would count its masked scores
            m_i, l_i, acc = _attend_tile(q, _widen(k0, q.dtype, FP8_CVT), _widen(v0, q.dtype, FP8_CVT),
                                         mask0[None, :], m_i, l_i, acc, qk_scale, SOFTCAP)
        first = start + BLOCK_N
    first = tl.maximum(first, lo)
    for n0 in range(first, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < end
        k = _widen(_kv_tile(k_cache, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                            BLOCK_SIZE), q.dtype, FP8_CVT)
        v = _widen(_kv_tile(v_cache, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                            BLOCK_SIZE), q.dtype, FP8_CVT)
        m_i, l_i, acc = _attend_tile(q, k, v, tok_mask[None, :], m_i, l_i, acc, qk_scale, SOFTCAP)
    if not SPLIT:
        out = acc / l_i[:, None]
        if IS_FP8:
            out = out * _scale(v_scale_ptr, v_scale_val, SCALE_PTR)
        tl.store(out_ptr + q_idx * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        # partials [B, Hq, splits, BLOCK_D] and [B, Hq, splits, 2] (m, l), fp32
        base = (b * (tl.num_programs(1) * G) + heads) * tl.num_programs(2) + sp
        tl.store(part_o + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml + base * 2, m_i, mask=row_mask)
        tl.store(part_ml + base * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _rope_row(t, pos_ptr, cos_sin_ptr, slot_ptr, stride_pos, offs_d, BLOCK_D: tl.constexpr):
    """Token t's RoPE factors over [BLOCK_D] (cos; sin negated on the first half: y1 = x1 cos - x2 sin, y2 = x2 cos
    + x1 sin) and its cache slot."""
    HALF: tl.constexpr = BLOCK_D // 2             # head_dim is a power of two on this path
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = offs_d % HALF
    cos = tl.load(cos_sin_ptr + pos * stride_pos + i).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_pos + HALF + i).to(tl.float32)
    sin = tl.where(offs_d < HALF, -sin, sin)
    return cos, sin, tl.load(slot_ptr + t).to(tl.int64)


@triton.jit
def _new_token(q, q_rows, m_i, l_i, acc, t, h, seq_len, start, stop, cos, sin, slot, k_ptr, v_ptr, k_cache, v_cache,
               k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, qk_scale, stride_kt, stride_kh, stride_vt,
               stride_vh, stride_cb, stride_cs, stride_ch, offs_d, d_mask, row_mask, BLOCK_D: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, FMAX: tl.constexpr, IS_FP8: tl.constexpr, SCALE_PTR: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """Token t of the decode step (kv head h): q [GP, BLOCK_D] rotated (neox, rounded to q's dtype as the stored
    twin is); where this program's tokens [start, stop) hold position seq_len - 1, k rotated, k and v stored by
    slot and folded into the softmax state (m = its score, l = 1, acc = v), else the state unchanged."""
    partner = (offs_d + BLOCK_D // 2) % BLOCK_D
    q2 = tl.load(q_rows + partner[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    q = (q.to(tl.float32) * cos[None, :] + q2 * sin[None, :]).to(q.dtype)
    k_row = k_ptr + t * stride_kt + h * stride_kh
    k = tl.load(k_row + offs_d).to(tl.float32) * cos + tl.load(k_row + partner).to(tl.float32) * sin
    k = _quantize(k.to(k_ptr.dtype.element_ty).to(tl.float32), k_scale_ptr, k_scale_val, FMAX, IS_FP8, SCALE_PTR)
    v = _quantize(tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d).to(tl.float32), v_scale_ptr, v_scale_val,
                  FMAX, IS_FP8, SCALE_PTR)
    k = _to_cache(k, k_cache)
    v = _to_cache(v, v_cache)
    last = seq_len - 1
    own = ((last >= start) & (last < stop)) != 0  # != 0: a boolean under every interpreter (3.9's & gives int32)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + offs_d
    keep = (d_mask & own & (slot >= 0)) != 0
    tl.store(k_cache + dst, k, mask=keep)
    tl.store(v_cache + dst, v, mask=keep)
    s = tl.sum(q.to(tl.float32) * _widen(k, q.dtype, False).to(tl.float32)[None, :], axis=1) * qk_scale  # [GP]
    s = _softcap(s, SOFTCAP)
    m_i = tl.where(own, s, m_i)
    l_i = tl.where(own, 1.0, l_i)
    acc = tl.where(own, _widen(v, q.dtype, False).to(tl.float32)[None, :], acc)                 # broadcast
    return q, m_i, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_o, part_ml, qsl_ptr, out_ptr, v_scale_ptr, v_scale_val, Hq, D, num_splits,
                          stride_ot, stride_oh, SPLITS_P2: tl.constexpr,
                          BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr, SCALE_PTR: tl.constexpr,
                          PDL: tl.constexpr):
    """Grid (B, Hq): merge the split partials of one query head."""
    pdl_start(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    base = (b * Hq + hq) * num_splits + offs_s
    m = tl.load(part_ml + base * 2, mask=s_mask, other=NEG)
    l = tl.load(part_ml + base * 2 + 1, mask=s_mask, other=0.0)
    w = tl.math.exp2(m - tl.max(m, axis=0))
    o = tl.load(part_o + base[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if IS_FP8:
        out = out * _scale(v_scale_ptr, v_scale_val, SCALE_PTR)
    q_idx = tl.load(qsl_ptr + b)
    tl.store(out_ptr + q_idx * stride_ot + hq * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


@triton.jit
def _query_rows(qsl_ptr, seq_lens_ptr, num_seqs, G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr):
    """The program's BLOCK_Q new tokens of one sequence x its query heads (row r: token r // GP, head r % GP) ->
    (sequence b, its first query row, query count, query block, seq_len, ctx = position of its first new token,
    qi [BLOCK_Q * GP] token of each row, g head of each row, row_mask)."""
    b = _find_seq(qsl_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    qb = tl.program_id(0) - (q_start // BLOCK_Q + b)
    seq_len = tl.load(seq_lens_ptr + b)
    r = tl.arange(0, BLOCK_Q * GP)
    qi = qb * BLOCK_Q + r // GP
    g = r % GP
    return b, q_start, q_len, qb, seq_len, seq_len - q_len, qi, g, (qi < q_len) & (g < G)


@triton.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with qsl[b] // BLOCK_Q + b <= pid: sequence b's query blocks start at that program id."""
    lo = num_seqs * 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Per-step values (sequence count, block-table width, sliced metadata pointers) must not each cost a compile.
@triton.jit(do_not_specialize=["num_seqs", "stride_tb", "window"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "qsl_ptr"])
def _prefill_kernel(q_ptr, k_cache, v_cache, tables_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
                    k_scale_ptr, v_scale_ptr, k_scale_val, v_scale_val, qk_scale, num_seqs, D, window,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_cb, stride_cs, stride_ch,
                    G: tl.constexpr, GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
                    SCALE_PTR: tl.constexpr, SOFTCAP: tl.constexpr):
    """Grid (T // BLOCK_Q + B, Hkv): BLOCK_Q new tokens of one sequence x its G query heads (rows r: token
    r // GP, head r % GP) against the cached prefix and the chunk itself, causal. Needs no host-side metadata
    beyond query_start_loc: each program finds its sequence by binary search. window > 0: keys from the block's
    first query's window on (a row's keys before its own window are masked; until its first visible key its
    softmax state holds masked scores, which that key's rescale by exp2(NEG - m) clears)."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GP
    h = tl.program_id(1)
    b, q_start, q_len, qb, seq_len, ctx, qi, g, row_mask = _query_rows(qsl_ptr, seq_lens_ptr, num_seqs, G, GP,
                                                                       BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + (h * G + g)[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)                          # [BLOCK_M, BLOCK_D]
    q_pos = ctx + qi
    # keys up to the block's last query; an empty block (past the sequence's queries) runs no iteration
    kv_end = tl.where(qb * BLOCK_Q < q_len, tl.minimum(seq_len, ctx + (qb + 1) * BLOCK_Q), 0)
    if IS_FP8:
        qk_scale = qk_scale * _scale(k_scale_ptr, k_scale_val, SCALE_PTR)
    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + b * stride_tb
    kv_start = tl.where(window > 0, tl.maximum(ctx + qb * BLOCK_Q - window + 1, 0), 0)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < kv_end
        k = _widen(_kv_tile(k_cache, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                            BLOCK_SIZE), q.dtype, False)
        v = _widen(_kv_tile(v_cache, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                            BLOCK_SIZE), q.dtype, False)
        causal = (toks[None, :] <= q_pos[:, None]) & tok_mask[None, :]
        causal = causal & ((toks[None, :] > q_pos[:, None] - window) | (window <= 0))
        m_i, l_i, acc = _attend_tile(q, k, v, causal, m_i, l_i, acc, qk_scale, SOFTCAP)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if IS_FP8:
        out = out * _scale(v_scale_ptr, v_scale_val, SCALE_PTR)
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + (h * G + g)[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
