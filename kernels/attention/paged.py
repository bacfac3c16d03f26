"""Paged attention, KV store and fused RoPE + store: Triton on CUDA, the torch twins (kernels/attention/reference.py)
on CPU. Same signatures as the twins.

paged_attention picks the decode kernel when T == B, i.e. when every sequence brings exactly one new token (the
engine's decode steps; a batch with T == B and some q_len != 1 is not supported), and the prefill kernel (causal,
varlen, any mix of chunk lengths including decodes) otherwise. Decode splits the context across programs when
B * Hkv programs alone cannot fill the GPU, then merges the partial softmaxes in a second kernel. The split count
depends only on shapes (block_tables.shape[1]), so a CUDA graph captures a fixed launch.
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.gpu import device_sms, runtime_for
from quant_serve.kernels.triton_compat import interpreting
from quant_serve.kernels.attention.merge import DecodePartials, merge_partials, scale_args
from quant_serve.kernels.attention.reference import apply_rope_ref, paged_attention_ref, rope_store_kv_ref, \
    store_kv_ref
from quant_serve.kernels.attention.kv_exact import ExactWindow
from quant_serve.kernels.attention.kv_int import is_int_cache
from quant_serve.kernels.attention.kv_int_paged import paged_attention_int, store_int_triton
from quant_serve.kernels.pdl import launch_options, pdl_enabled

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64              # context tokens per loop step
    num_warps: int = 4
    num_stages: int = 2
    waves: float = 2.0             # aim for this many programs per SM before splitting stops
    min_split_tokens: int = 256    # never split finer than this
    num_splits: int | None = None  # force a split count (tests, tuning)
    fp8_asm: bool = False          # fp8 cache: widen tiles by inline asm in registers (attention_triton._widen)
    early_tile: bool = False       # with the new tokens folded in: the first K/V tile read before the PDL wait


FEW_PROGRAMS = 64     # up to this many programs (batch x kv heads) the decode rule splits the context finely


def decode_graph_contexts(programs: int, max_ctx: int, is_fp8: bool, device: torch.device,
                          smallest: int = 1024) -> list[int]:
    """Block-table widths (tokens) to capture decode CUDA graphs at for B * Hkv programs, narrowest first; a graph
    serves the batches whose longest context fits its width. Where the rule splits finely (<= FEW_PROGRAMS) the
    split count follows the table, so one table max_model_len wide would split short contexts into mostly empty
    programs (or, with the coarse wide_table rule, miss the fine configurations: fp8 at batch 1 x 512 tokens 8.3
    against 6.1 us in a graph, bench/results/exp-graph-decode-h200.json): widths double from `smallest`, and a width
    whose launch (configuration and split count) is the next wider one's is left out: its graph would be the same.
    Above FEW_PROGRAMS whole contexts are kept a program and one wide table serves every length (decode_config's
    wide_table)."""
    if programs > FEW_PROGRAMS:
        return [max_ctx]

    def launch(width: int):
        cfg = decode_config(is_fp8, programs, width)
        return cfg, decode_splits(programs, width, device, cfg)

    widths = [max_ctx]
    width = smallest
    while width < max_ctx:
        widths.append(width)
        width *= 2
    kept = [max_ctx]
    for width in sorted(widths[1:], reverse=True):
        if launch(width) != launch(kept[0]):
            kept.insert(0, width)
    return kept


def decode_config(is_fp8: bool, programs: int, max_ctx: int, wide_table: bool = False) -> DecodeConfig:
    """The decode kernel's configuration for B * Hkv programs over a block table of max_ctx tokens. Fitted on the
    H200 (bench/results/decode-tune-h200.json and decode-tune-asm-h200.json: 18 configurations, batch 1-256 x
    context 512-8192, Qwen2.5-7B heads): up to 64 programs the context is split finely (fp16: 64-token splits
    toward 8 programs an SM; fp8: 128-token tiles, 4 an SM), above they keep whole contexts (fp8 with three stages
    of loads in flight: batch 256 x 512 / 2048 / 8192 tokens 67.6 / 243.4 / 955.6 us against 69.5 / 249.3 / 979.4
    with two, decode-tune-stages-h200.json; batch 64 within 2% either way). The asm widening of fp8 tiles pays
    only where every program reads a tile or two (it gives up the cp.async pipeline of the cast that Triton makes:
    slower on long contexts).
    wide_table (a CUDA graph's table, sized for max_model_len, not for the contexts it will hold): the split count
    cannot follow the contexts, and fine splits over a wide table cost short contexts more than they give long
    ones (docs/kernels.md, "wide_table"):
    2 programs an SM, 256-token splits. engine/worker/cuda_graph.py captures such graphs only above FEW_PROGRAMS
    (decode_graph_contexts).
    early_tile (64-token tiles of few programs; the 128-token fp8 tile held across the wait spills): each program
    reads its first K/V tile before the PDL wait, overlapping the qkv matmul's tail (docs/kernels.md, "early_tile")."""
    if wide_table:
        return DecodeConfig(block_n=128) if is_fp8 else DecodeConfig()
    few = programs <= FEW_PROGRAMS
    if is_fp8:
        if programs <= 8 and max_ctx <= 1024:     # a tile or two a program (docs/kernels.md, "fp8_asm")
            return DecodeConfig(block_n=64, waves=8.0, min_split_tokens=64, fp8_asm=True, early_tile=True)
        if few:
            return DecodeConfig(block_n=128, waves=4.0, min_split_tokens=128, fp8_asm=max_ctx <= 1024)
        return DecodeConfig(block_n=128, num_stages=3)
    if few:
        return DecodeConfig(block_n=64, waves=8.0, min_split_tokens=64, early_tile=True)
    return DecodeConfig(block_n=64, num_stages=3)


@dataclass
class NewTokens:
    """The decode step's new tokens for paged_decode to rotate and store itself (the RoPE/KV-store launch folded
    into the decode kernel): k, v [B, Hkv, D] before RoPE, positions [B], cos_sin_cache [max_pos, D], slot_mapping
    [B] (-1 = not stored)."""
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _fp8_cvt(q: torch.Tensor, cache_dtype: torch.dtype) -> bool:
    """Widen fp8 K/V tiles by inline asm in the decode kernel (attention_triton._widen)? fp16 queries on a GPU
    whose runtime has the fp8 conversion (sm_89+: cvt.rn.f16x2.e4m3x2), not under the interpreter (no asm)."""
    if cache_dtype not in FP8 or q.dtype != torch.float16 or not q.is_cuda or interpreting():
        return False
    return runtime_for(q.device).caps.fp8_cvt


def e4m3_in_software(device: torch.device) -> bool:
    """Does an e4m3 cache on this device go to the kernels as bytes, converted in software? On a GPU whose runtime
    has no fp8 conversion (sm80 / sm86, or their profile): Triton has no e4m3 type there."""
    return device.type == "cuda" and not interpreting() and not runtime_for(device).caps.fp8_cvt


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: an e4m3 cache as its bytes where e4m3_in_software (attention_triton's
    _e4m3_to_f16 / _f32_to_e4m3 convert exactly), else as it is."""
    if cache.dtype == torch.float8_e4m3fn and e4m3_in_software(cache.device):
        return cache.view(torch.uint8)
    return cache


def _num_sms(device: torch.device) -> int:
    return device_sms(device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, softmax_scale: float, k_scale=1.0,
                    v_scale=1.0, window: int = 0, softcap: float = 0.0, multi_token: bool = False,
                    wide_table: bool = False, exact: ExactWindow | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]; seq_lens [B] (context
    including the new tokens); query_start_loc [B+1]. -> [T, Hq, D] in q's dtype. window, softcap: as
    attention_ref.paged_attention_ref (0: off). multi_token: the prefill kernel even where T == B (a CUDA graph's
    fixed rows, whose per-sequence lengths only the device knows). wide_table: as paged_decode. exact: an
    integer cache's exact window (kernels/attention/kv_exact.py)."""
    if not q.is_cuda:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale,
                                   k_scale, v_scale, window, softcap, exact)
    if is_int_cache(k_cache):       # k_scale / v_scale: the caches' group scales (kernels/attention/kv_int.py)
        decode = q.shape[0] == block_tables.shape[0] and not multi_token
        splits = decode_splits(block_tables.shape[0] * k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                               q.device, DecodeConfig()) if decode else 1
        return paged_attention_int(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale,
                                   k_scale, v_scale, window, softcap, exact, num_splits=splits)
    if q.shape[0] == block_tables.shape[0] and not multi_token:
        return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale,
                            k_scale, v_scale, window=window, softcap=softcap, wide_table=wide_table)
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale,
                         k_scale, v_scale, window=window, softcap=softcap)


MAX_SPLITS = 128      # the merge kernel holds [splits, head_dim] fp32 partials of a head in registers


def decode_splits(programs: int, max_ctx: int, device: torch.device, cfg: DecodeConfig) -> int:
    sms = _num_sms(device) if device.type == "cuda" else 8      # the interpreter has no SMs; any count is right
    return split_count(programs, max_ctx, sms, cfg)


def split_count(programs: int, max_ctx: int, sms: int, cfg: DecodeConfig) -> int:
    """Context splits of a decode launch of B * Hkv programs over max_ctx tokens on `sms` SMs: toward cfg.waves
    programs an SM, never under cfg.min_split_tokens a split."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    want = -(-int(cfg.waves * sms) // programs)
    return max(1, min(want, max_ctx // cfg.min_split_tokens, MAX_SPLITS))


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale, k_scale=1.0,
                 v_scale=1.0, cfg: DecodeConfig | None = None, new: NewTokens | None = None,
                 wide_table: bool = False, merge: bool = True, window: int = 0,
                 softcap: float = 0.0) -> torch.Tensor | DecodePartials:
    """One query token per sequence. new: q and new.k are before RoPE; the kernel rotates them and stores
    new.k / new.v by slot before attending (needs head_dim a power of two), as rope_store_kv + paged_decode.
    wide_table: block_tables are sized for the longest context allowed, not for these (decode_config).
    merge False: where the context is split (and head_dim is a power of two), the split partials unmerged, for
    the consumer to merge (kernels/attention/merge.py); else the output [B, Hq, D]."""
    from quant_serve.kernels.attention.triton_kernels import _decode_kernel
    if is_int_cache(k_cache):
        raise ValueError("paged_decode reads float / fp8 caches; an integer cache goes through paged_attention")
    is_fp8 = k_cache.dtype in FP8
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    block_d = _next_pow2(head_dim)
    max_ctx = block_tables.shape[1] * block_size
    cfg = cfg or decode_config(is_fp8, batch * num_kv_heads, max_ctx, wide_table)
    splits = max(1, min(decode_splits(batch * num_kv_heads, max_ctx, q.device, cfg), -(-max_ctx // cfg.block_n)))
    out = torch.empty_like(q)
    ks_ptr, ks_val, from_ptr = scale_args(k_scale, q)
    vs_ptr, vs_val, _ = scale_args(v_scale, q)
    part_o = part_ml = out
    pdl = pdl_enabled(q)
    if new is not None and (block_d != head_dim or new.cos_sin_cache.shape[1] != head_dim or
                            min(q.stride(2), new.k.stride(2), new.v.stride(2), new.cos_sin_cache.stride(1)) != 1):
        raise ValueError("paged_decode with new tokens needs head_dim a power of two, cos_sin_cache [max_pos, "
                         "head_dim] and unit stride along head_dim")
    nk = new or NewTokens(q, q, seq_lens, q, seq_lens)                     # placeholders: ROPE off
    if splits > 1:
        part_o = torch.empty((batch, num_q_heads, splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, num_q_heads, splits, 2), dtype=torch.float32, device=q.device)
    kc, vc = _kernel_view(k_cache), _kernel_view(v_cache)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, kc, vc, block_tables, seq_lens, query_start_loc, out, part_o, part_ml,
        ks_ptr, vs_ptr, ks_val, vs_val, softmax_scale * LOG2E, head_dim, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        nk.k, nk.v, nk.positions, nk.cos_sin_cache, nk.slot_mapping, nk.k.stride(0), nk.k.stride(1), nk.v.stride(0),
        nk.v.stride(1), nk.cos_sin_cache.stride(0),
        G=group, GP=max(16, _next_pow2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        SPLIT=splits > 1, IS_FP8=is_fp8, SCALE_PTR=from_ptr, PDL=pdl, ROPE=new is not None,
        FMAX=_fmax(k_cache.dtype), FP8_CVT=cfg.fp8_asm and _fp8_cvt(q, k_cache.dtype),
        EARLY_TILE=cfg.early_tile and new is not None, SOFTCAP=softcap * LOG2E, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(pdl))
    if splits == 1:
        return out
    partials = DecodePartials(part_o, part_ml, seq_lens, query_start_loc, out, cfg.block_n,
                              v_scale if is_fp8 else None)
    return partials if not merge and block_d == head_dim else merge_partials(partials)


def paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale, k_scale=1.0,
                  v_scale=1.0, block_m: int = 128, block_n: int = 64, num_warps: int = 8,
                  num_stages: int = 2, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    from quant_serve.kernels.attention.triton_kernels import _prefill_kernel
    if is_int_cache(k_cache):
        return paged_attention_int(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, softmax_scale,
                                   k_scale, v_scale, window, softcap)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    gp = _next_pow2(group)
    block_q = max(1, block_m // gp)
    out = torch.empty_like(q)
    ks_ptr, ks_val, from_ptr = scale_args(k_scale, q)
    vs_ptr, vs_val, _ = scale_args(v_scale, q)
    kc, vc = _kernel_view(k_cache), _kernel_view(v_cache)
    _prefill_kernel[(num_tokens // block_q + batch, num_kv_heads)](
        q, kc, vc, block_tables, seq_lens, query_start_loc, out, ks_ptr, vs_ptr, ks_val, vs_val,
        softmax_scale * LOG2E, batch, head_dim, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, GP=gp, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=_next_pow2(head_dim), BLOCK_SIZE=block_size,
        IS_FP8=k_cache.dtype in FP8, SCALE_PTR=from_ptr, SOFTCAP=softcap * LOG2E, num_warps=num_warps,
        num_stages=num_stages)
    return out


def _fmax(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max) if dtype in FP8 else 0.0


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """key, value: [T, Hkv, D]; slot_mapping [T], -1 = skip. fp8 caches store clamp(x / scale)."""
    if not key.is_cuda:
        return store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    from quant_serve.kernels.attention.kv_store import _store_kv_kernel
    if is_int_cache(k_cache):
        return store_int_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = key.shape
    ks_ptr, ks_val, from_ptr = scale_args(k_scale, key)
    vs_ptr, vs_val, _ = scale_args(v_scale, key)
    kc, vc = _kernel_view(k_cache), _kernel_view(v_cache)
    _store_kv_kernel[(num_tokens,)](
        key, value, kc, vc, slot_mapping, ks_ptr, vs_ptr, ks_val, vs_val, num_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=_next_pow2(num_heads), BLOCK_D=_next_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        FMAX=_fmax(k_cache.dtype), IS_FP8=k_cache.dtype in FP8, SCALE_PTR=from_ptr, num_warps=4)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
    """Neox RoPE on q [T, Hq, D] and k [T, Hkv, D] in place, then store k and v [T, Hkv, D] by slot_mapping.
    cos_sin_cache: [max_position, D] (layout in kernels/attention/reference.py)."""
    if not q.is_cuda:
        return rope_store_kv_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                 k_scale, v_scale)
    rope_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rope_store_kv_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=1.0,
                         v_scale=1.0) -> None:
    from quant_serve.kernels.attention.kv_store import _rope_store_kv_kernel
    if is_int_cache(k_cache):       # RoPE on q and k in place and the quantizing store: one kernel
        from quant_serve.kernels.attention.kv_int_prologue import fits, int_prologue_triton
        if fits(q, cos_sin_cache):
            int_prologue_triton(q, k, v, positions, cos_sin_cache, False, k_cache, v_cache, slot_mapping, k_scale,
                                v_scale, out=(q, k, v))
            return
        q.copy_(apply_rope_ref(q, positions, cos_sin_cache))
        k.copy_(apply_rope_ref(k, positions, cos_sin_cache))
        return store_int_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if cos_sin_cache.shape[1] != head_dim or min(q.stride(2), k.stride(2), cos_sin_cache.stride(1)) != 1:
        raise ValueError("rope_store_kv needs cos_sin_cache [max_pos, head_dim] and unit stride along head_dim")
    ks_ptr, ks_val, from_ptr = scale_args(k_scale, k)
    vs_ptr, vs_val, _ = scale_args(v_scale, k)
    half = head_dim // 2
    pdl = pdl_enabled(q)
    kc, vc = _kernel_view(k_cache), _kernel_view(v_cache)
    _rope_store_kv_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_sin_cache, kc, vc, slot_mapping, ks_ptr, vs_ptr, ks_val, vs_val,
        num_q_heads, num_kv_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_HQ=_next_pow2(num_q_heads), BLOCK_HKV=_next_pow2(num_kv_heads), HALF=half,
        BLOCK_HALF=_next_pow2(half), BLOCK_SIZE=k_cache.shape[1], FMAX=_fmax(k_cache.dtype),
        IS_FP8=k_cache.dtype in FP8, SCALE_PTR=from_ptr, PDL=pdl, num_warps=4, **launch_options(pdl))
