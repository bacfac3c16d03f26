"""Torch twin of paged attention and the KV store: the CPU path and the reference for the Triton kernels.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim], dtype fp16/bf16/fp32 or fp8
(e4m3/e5m2). An fp8 cache holds clamp(x / scale) and is read back as fp8 * scale (per-layer scalar scales).
An integer cache (int8 codes, or int4 codes packed in uint8) takes its per-token group scales tensor where an fp8
cache takes its scalar scale (format: kernels/attention/kv_int.py).
`slot_mapping[t] = block_id * block_size + offset` is the one contract between the block manager and this code.
"""
import torch

from quant_serve.kernels.attention.kv_exact import ExactWindow, gather_exact
from quant_serve.kernels.attention.kv_int import dequantize_int, is_int_cache, store_int_ref


def _as_scale(scale) -> torch.Tensor | float:
    return scale if isinstance(scale, torch.Tensor) else float(scale)


def quantize_to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale) -> torch.Tensor:
    """Convert new K or V values to the cache dtype; fp8 divides by the scale and clamps before the cast."""
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(cache_dtype).max
        return (x.float() / _as_scale(scale)).clamp(-fmax, fmax).to(cache_dtype)
    return x.to(cache_dtype)


def dequantize_from_cache(x: torch.Tensor, out_dtype: torch.dtype, scale) -> torch.Tensor:
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (x.float() * _as_scale(scale)).to(out_dtype)
    return x.to(out_dtype)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """key, value: [T, Hkv, D]; slot_mapping: [T] int64, -1 = do not store (padding)."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if is_int_cache(k_cache):
        store_int_ref(key[valid], k_cache, k_scale, slots)
        store_int_ref(value[valid], v_cache, v_scale, slots)
        return
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat[slots] = quantize_to_cache(key[valid], k_cache.dtype, k_scale)
    v_flat[slots] = quantize_to_cache(value[valid], v_cache.dtype, v_scale)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        softmax_scale: float, k_scale=1.0, v_scale=1.0, window: int = 0,
                        softcap: float = 0.0, exact: ExactWindow | None = None) -> torch.Tensor:
    """Causal attention of new queries over each sequence's paged context (its prefix plus the new tokens).

    q: [T, Hq, D] (new tokens of all sequences, flattened); block_tables: [B, max_blocks] int;
    seq_lens: [B] context length including the new tokens; query_start_loc: [B+1], seq b owns
    q[query_start_loc[b]:query_start_loc[b+1]], which are the last positions of its context.
    window > 0 (a sliding-window layer): the query at position p sees keys p - window + 1 .. p only, as in the
    Hugging Face masks. softcap > 0 (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax.
    exact (an integer cache's exact window, kernels/attention/kv_exact.py): keys and values read unquantized where
    its rule says so. Returns [T, Hq, D] in q's dtype. Math in fp32.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    exact_all = None if exact is None else (exact.size, *gather_exact(exact, seq_lens, query_start_loc))
    if decodes:  # all single-token queries at once: the common decode batch
        rows = torch.tensor([starts[b] for b in decodes], device=q.device)
        idx = torch.tensor(decodes, device=q.device)
        out[rows] = _attend(q[rows].unsqueeze(1), k_cache, v_cache, block_tables[idx], seq_lens[idx],
                            torch.ones(len(decodes), dtype=torch.long, device=q.device), softmax_scale,
                            k_scale, v_scale, window, softcap, _rows(exact_all, idx)).squeeze(1)
    for b, n in enumerate(q_lens):
        if n > 1:
            out[starts[b]:starts[b + 1]] = _attend(q[starts[b]:starts[b + 1]].unsqueeze(0), k_cache, v_cache,
                                                   block_tables[b:b + 1], seq_lens[b:b + 1],
                                                   torch.tensor([n], device=q.device), softmax_scale,
                                                   k_scale, v_scale, window, softcap,
                                                   _rows(exact_all, slice(b, b + 1)))[0]
    return out


def _rows(exact_all, idx):
    """The exact window's gathered (size, positions, k, v, at hand) of some sequences."""
    if exact_all is None:
        return None
    size, pos, k, v, have = exact_all
    return size, pos[idx], k[idx], v[idx], have[idx]


def _attend(q: torch.Tensor, k_cache, v_cache, block_tables, seq_lens, q_lens, softmax_scale, k_scale, v_scale,
            window: int, softcap: float, exact=None):
    """q: [B, Q, Hq, D], right-aligned in each sequence's context -> [B, Q, Hq, D]. GQA without copying K/V.
    exact: (R, k, v [B, >= L, Hkv, D] fp32, at hand [B, >= L]) of the exact window."""
    batch, q_max, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)].long()
    k = _gather(k_cache, k_scale, tables, max_len)                                       # [B, L, Hkv, D] fp32
    v = _gather(v_cache, v_scale, tables, max_len)
    # query i of sequence b sits at position seq_len - q_len + i and sees keys 0..that position
    q_pos = (seq_lens - q_lens).view(batch, 1) + torch.arange(q_max, device=q.device)   # [B, Q]
    k_pos = torch.arange(max_len, device=q.device)
    qg = q.float().view(batch, q_max, num_kv_heads, group, head_dim)
    ue = None
    if exact is not None:
        # the exact window's W positions of each sequence (kv_exact.gather_exact); those a query uses replace the
        # dequantized key / value there: at hand, inside the query's last `size` positions, and visible
        size, pos, ek, ev, have = exact
        use = have.unsqueeze(1) & (pos.unsqueeze(1) > q_pos.unsqueeze(-1) - size) \
            & (pos.unsqueeze(1) <= q_pos.unsqueeze(-1))                                # [B, Q, W]
        at = pos.clamp(min=0)                  # (positions before the sequence are never used, only read)
        if q_max == 1:      # one query a sequence: which keys are exact does not depend on the query
            b, w = use[:, 0].nonzero(as_tuple=True)
            k[b, pos[b, w]] = ek[b, w]
            v[b, pos[b, w]] = ev[b, w]
        else:
            ue = use.view(batch, 1, 1, q_max, -1)
            v_at = v[torch.arange(batch, device=q.device).view(-1, 1), at]             # [B, W, Hkv, D]
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k)                                   # [B, Hkv, G, Q, L]
    if ue is not None:
        s_exact = torch.einsum("bqhgd,bkhd->bhgqk", qg, ek)                             # [B, Hkv, G, Q, W]
        b, i, w = use.nonzero(as_tuple=True)
        scores.permute(0, 3, 4, 1, 2)[b, i, pos[b, w]] = s_exact.permute(0, 3, 4, 1, 2)[b, i, w]
        idx = at.view(batch, 1, 1, 1, -1).expand(*scores.shape[:-1], at.shape[1])
    scores = scores * softmax_scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    visible = k_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)                               # [B, Q, L]
    if window > 0:
        visible &= k_pos.view(1, 1, -1) > q_pos.unsqueeze(-1) - window
    scores.masked_fill_(~visible.view(batch, 1, 1, q_max, max_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
    if ue is not None:      # the used positions' weights move from the dequantized values to the exact ones
        p_at = probs.gather(-1, idx) * ue
        out = out + torch.einsum("bhgqk,bkhd->bqhgd", p_at, ev - v_at)
    return out.reshape(batch, q_max, num_q_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, scale, tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """The first max_len tokens of each sequence's blocks, fp32 [B, L, Hkv, D]; an integer cache gathers its
    scales by the same block ids and dequantizes just those tokens."""
    if is_int_cache(cache):
        return dequantize_int(cache[tables].flatten(1, 2)[:, :max_len], scale[tables].flatten(1, 2)[:, :max_len])
    return dequantize_from_cache(cache[tables].flatten(1, 2)[:, :max_len], torch.float32, scale)


# ---- RoPE (neox / rotate_half style, as in the Hugging Face Llama and Qwen2 code) ----
# cos_sin_cache: [max_position, head_dim] fp32; row p = [cos(p * inv_freq), sin(p * inv_freq)], each half head_dim
# wide, inv_freq[i] = base ** (-2i / head_dim) (or a model's scaled inv_freq). Dimension i < head_dim/2 rotates
# with dimension i + head_dim/2: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.

def build_cos_sin_cache(max_position: int, head_dim: int, base: float = 10000.0,
                        inv_freq: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """[max_position, head_dim] fp32 cos | sin table (computed in fp64)."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq.to(torch.float64))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32).to(device)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D], positions: [T] -> rotated x in x's dtype (math in fp32). A table narrower than D (partial
    rotary, Phi-4-mini) rotates the first cos_sin_cache.shape[1] dimensions and passes the rest through."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cs = cos_sin_cache[positions].float()                              # [T, rot]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rot:]], dim=-1).to(x.dtype)


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place, then store k (rotated) and v by slot_mapping."""
    if cos_sin_cache.shape[1] > q.shape[-1] or cos_sin_cache.shape[1] % 2:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} must be even and at most head_dim "
                         f"{q.shape[-1]}")
    q.copy_(apply_rope_ref(q, positions, cos_sin_cache))
    k.copy_(apply_rope_ref(k, positions, cos_sin_cache))
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
