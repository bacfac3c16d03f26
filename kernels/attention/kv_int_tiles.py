"""The integer cache's fast tile path (one scale per token and kv head, the int8 / int4 defaults): attention reads
the codes themselves, never a dequantized tile. With x = c s (+ z) per token,

    q . k_n = s_n (q . c_n) (+ z_n sum(q)),        sum_n p_n v_n = sum_n (p_n s_n) c_n (+ sum_n p_n z_n),

so the scores scale by each key's s after one dot with the codes, and the values' scales go into P's columns before
the second: the tensor cores multiply exact small integers (int8 / int4 codes are exact in fp16 and bf16), and a
tile costs an unpack and a convert a code instead of a gather, a multiply and an add an element. int4 codes are read
as 32-bit words (eight codes a word: element 2i in byte i's low nibble, so code j of a word sits at bits 4j).
"""
from quant_serve.kernels.attention.triton_kernels import _online_softmax
from quant_serve.kernels.triton_compat import tl, triton


@triton.jit
def _codes_tile(codes_ptr, scales_ptr, table_row, toks, tok_mask, h, stride_cb, stride_cs, stride_ch, stride_sb,
                stride_ss, stride_sh, dtype, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr, ZP: tl.constexpr):
    """Tokens `toks` of one sequence, kv head h -> (codes [BLOCK_N, BLOCK_D] in dtype, centred where symmetric;
    scale [BLOCK_N] fp32; zero [BLOCK_N] fp32, 0 unless ZP): x = codes * scale + zero. Masked tokens: all 0."""
    blk = tl.load(table_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    pos = toks % BLOCK_SIZE
    row = blk * stride_cb + pos * stride_cs + h * stride_ch                      # [BLOCK_N] byte offsets
    if BITS == 8:
        offs_d = tl.arange(0, BLOCK_D)
        c = tl.load(codes_ptr + row[:, None] + offs_d[None, :], mask=tok_mask[:, None], other=0).to(dtype)
    else:
        W: tl.constexpr = BLOCK_D // 8
        words_ptr = codes_ptr.to(tl.pointer_type(tl.int32))
        offs_w = tl.arange(0, W)
        words = tl.load(words_ptr + (row // 4)[:, None] + offs_w[None, :], mask=tok_mask[:, None], other=0)
        nib = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15                # [BLOCK_N, W, 8]
        if not ZP:
            nib = tl.where(tok_mask[:, None, None], nib - 8, 0)
        c = tl.reshape(nib, (BLOCK_N, BLOCK_D)).to(dtype)
    s_row = blk * stride_sb + pos * stride_ss + h * stride_sh
    scale = tl.load(scales_ptr + s_row, mask=tok_mask, other=0.0).to(tl.float32)
    zero = tl.zeros([BLOCK_N], tl.float32)
    if ZP:
        zero = tl.load(scales_ptr + s_row + 1, mask=tok_mask, other=0.0).to(tl.float32)
    return c, scale, zero


@triton.jit
def _attend_codes(q, q_sum, ck, k_scale, k_zero, cv, v_scale, v_zero, s_mask, m_i, l_i, acc, qk_scale,
                  SOFTCAP: tl.constexpr, ZP: tl.constexpr):
    """_attend_tile (triton_kernels.py) on codes: q [R, D], ck / cv [N, D] codes in q's dtype, scales / zeros [N];
    q_sum [R] fp32 (sum of q over D, for the zero points)."""
    s = tl.dot(q, tl.trans(ck)) * k_scale[None, :]
    if ZP:
        s += q_sum[:, None] * k_zero[None, :]
    p, alpha, m_new, l_i = _online_softmax(s, s_mask, m_i, l_i, qk_scale, SOFTCAP)
    acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(cv.dtype), cv)
    if ZP:
        acc += tl.sum(p * v_zero[None, :], axis=1)[:, None]
    return m_new, l_i, acc
