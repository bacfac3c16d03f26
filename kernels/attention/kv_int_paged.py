"""Launchers of the integer KV cache's Triton kernels (kernels/attention/kv_int_kernels.py); same signatures as the
float ones in kernels/attention/paged.py, with each cache's scales tensor where an fp8 cache has its scalar scale.
"""
import torch

from quant_serve.kernels.attention.kv_exact import ExactWindow
from quant_serve.kernels.attention.kv_int import format_of

LOG2E = 1.4426950408889634


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(codes: torch.Tensor, scales: torch.Tensor, head_dim: int):
    fmt = format_of(codes, scales)
    if head_dim & (head_dim - 1) or fmt.group & (fmt.group - 1):
        raise ValueError(f"integer KV kernels need head_dim ({head_dim}) and the group ({fmt.group}) powers of two")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("integer KV kernels need contiguous codes and scales")
    return fmt


NUM_STAGES = 3        # the main loop's pipelined loads (an exact window's tail loop runs in one stage)


def int_attention_tiles(decode: bool, exact: bool, block_m: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) of the integer-cache attention kernel: a decode batch one query token a program, other
    batches block_m // GP tokens. 32-token key tiles for decode and windowed steps, else 64: spills and registers read
    off the sm86 compile (no GPU timing yet: docs/kernels.md, "Decode attention")."""
    gp = max(16, _next_pow2(group))          # tl.dot needs 16 rows
    block_q = 1 if decode else max(1, block_m // gp)
    return block_q, 32 if decode or exact else 64


def store_int_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    """key, value [T, Hkv, D] quantized into the slots of the codes / scales (slot -1: skipped)."""
    from quant_serve.kernels.attention.kv_int_kernels import _int_store_kernel
    num_tokens, num_heads, head_dim = key.shape
    fmt = _check(k_cache, k_scales, head_dim)
    for x, codes, scales in ((key, k_cache, k_scales), (value, v_cache, v_scales)):
        if x.stride(2) != 1:
            raise ValueError("store_int_triton needs unit stride along head_dim")
        _int_store_kernel[(num_tokens,)](
            x, codes, scales, slot_mapping, num_heads, x.stride(0), x.stride(1),
            codes.stride(0), codes.stride(1), codes.stride(2), scales.stride(0), scales.stride(1), scales.stride(2),
            BLOCK_H=_next_pow2(num_heads), BLOCK_D=head_dim, BLOCK_SIZE=codes.shape[1], GROUP=fmt.group,
            BITS=fmt.bits, ZP=fmt.zero_point, num_warps=4)


def paged_attention_int(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, softmax_scale: float,
                        k_scales: torch.Tensor, v_scales: torch.Tensor, window: int = 0, softcap: float = 0.0,
                        exact: ExactWindow | None = None, block_m: int = 64, block_n: int | None = None,
                        num_warps: int = 4, num_splits: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] against the quantized paged context -> [T, Hq, D]. A decode batch (T == B) runs one query
    token a program; other batches BLOCK_Q = block_m // GP tokens a program. exact: the exact window
    (kernels/attention/kv_exact.py). num_splits (decode batches): each context split across that many programs, the
    partials merged (kernels/attention/merge.py); paged.paged_attention passes the fp16 decode's count
    (paged.decode_splits: it depends only on shapes, so a CUDA graph captures one launch)."""
    from quant_serve.kernels.attention.kv_int_kernels import _int_attention_kernel
    num_tokens, num_q_heads, head_dim = q.shape
    fmt = _check(k_cache, k_scales, head_dim)
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    batch = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    gp = max(16, _next_pow2(group))          # tl.dot needs 16 rows
    block_q, tiles_n = int_attention_tiles(num_tokens == batch, exact is not None, block_m, group)
    block_n = block_n or tiles_n
    splits = (num_splits or 1) if block_q == 1 else 1
    out = torch.empty_like(q)
    part_o = part_ml = out
    if splits > 1:
        part_o = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, num_q_heads, splits, 2), dtype=torch.float32, device=q.device)
    if q.stride(2) != 1:
        raise ValueError("paged_attention_int needs unit stride along head_dim")
    if exact is not None:
        rows = exact.rows
        if exact.new_k.stride(2) != 1 or exact.new_k.stride() != exact.new_v.stride() or not (
                exact.ring_k.is_contiguous() and exact.ring_v.is_contiguous()):
            raise ValueError("paged_attention_int: the exact window's new K/V need unit stride along head_dim and "
                             "the same strides, its rings contiguous")
        ring_args = (exact.new_k, exact.new_v, exact.ring_k, exact.ring_v, rows.ring_row, rows.ring_lo, rows.ring_hi,
                     exact.new_k.stride(0), exact.new_k.stride(1), exact.ring_k.stride(1), exact.ring_k.stride(2))
        ring = exact.size
    else:
        ring_args = (q, q, q, q, seq_lens, seq_lens, seq_lens, 0, 0, 0, 0)      # unused (RING = 0)
        ring = 0
    _int_attention_kernel[(num_tokens // block_q + batch, num_kv_heads, splits)](
        q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, query_start_loc, out,
        softmax_scale * LOG2E, batch, window, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0), k_scales.stride(1), k_scales.stride(2), *ring_args, part_o, part_ml, num_q_heads,
        G=group, GP=gp, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=head_dim, BLOCK_SIZE=block_size,
        GROUP=fmt.group, BITS=fmt.bits, ZP=fmt.zero_point, SOFTCAP=softcap * LOG2E, RING=ring,
        SPLITS=splits, num_warps=num_warps, num_stages=NUM_STAGES)
    if splits > 1:
        from quant_serve.kernels.attention.merge import DecodePartials, merge_partials
        merge_partials(DecodePartials(part_o, part_ml, seq_lens, query_start_loc, out, block_n, None))
    return out
