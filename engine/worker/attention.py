"""Per-step attention metadata and the call into the paged-attention kernels (Triton on CUDA, torch twin on CPU)."""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quant_serve.kernels.attention.kv_exact import ExactRows, ExactWindow, write_ring
from quant_serve.kernels.attention.kv_int import is_int_cache
from quant_serve.kernels.attention.kv_int_prologue import fits, int_prologue_triton, rotate_triton
from quant_serve.kernels.attention.reference import apply_rope_ref
from quant_serve.kernels.attention.merge import DecodePartials
from quant_serve.kernels.attention.paged import NewTokens, paged_attention, paged_decode, rope_store_kv, store_kv


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token, -1 = padding (not stored)
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor          # [B] int32: context length per sequence including its new tokens
    query_start_loc: torch.Tensor   # [B+1] int32: sequence b owns tokens [query_start_loc[b], query_start_loc[b+1])
    max_seq_len: int
    max_query_len: int
    # Mixed steps: the first num_decodes sequences have one query token each and run the decode kernel; the rest
    # run the prefill kernel with prefill_query_start_loc ([B - num_decodes + 1] int32, starting at 0).
    num_decodes: int = 0
    prefill_query_start_loc: torch.Tensor | None = None
    # Calibration hook: called with (k, v, k_scale, v_scale) of each layer before the store; may set the scales.
    kv_observer: Callable | None = None
    # block_tables sized for max_model_len, not for these sequences (a CUDA graph): the decode kernel's split
    # count cannot follow the contexts (kernels/attention/paged.decode_config)
    wide_table: bool = False
    # several query tokens per sequence in a CUDA graph's fixed rows (engine/spec/graphs.py): the prefill kernel,
    # even where the row count happens to equal the sequence count
    multi_token: bool = False
    # one decode row per token of a verification (engine/spec/graphs.py, VerifyRowGraphs): rows of one sequence in
    # one launch read each other's K/V, so the store runs before the decode kernel instead of inside it
    store_first: bool = False
    # an integer cache's exact window: the step's ring rows (engine/worker/kv_exact_rows.py); eager steps only
    exact_rows: ExactRows | None = None


def paged_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale,
                            v_scale, meta: AttentionMetadata, softmax_scale: float,
                            merge: bool = True, window: int = 0, softcap: float = 0.0,
                            rotation: torch.Tensor | None = None,
                            rings: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | DecodePartials:
    """q: [T, Hq, D], k/v: [T, Hkv, D] before RoPE; positions [T]; cos_sin_cache [max_pos, D].
    Rotates q and k, stores k/v by slot_mapping (one fused kernel on CUDA), then attends. -> [T, Hq, D]
    A decode step on CUDA does all of it in the decode kernel (one launch instead of two); otherwise q and k are
    rotated in place. merge False: a decode step whose context is split may return the unmerged partials
    (kernels/attention/merge.py) for o_proj to merge. window, softcap: a sliding-window layer's window and the
    score soft-cap (kernels/attention/reference.paged_attention_ref; 0: off). A cos_sin_cache narrower than head_dim
    (partial rotary) is applied in torch, then stored by the store kernel. rotation [D, D] (a rotated integer
    cache, kernels/attention/kv_int.hadamard): q, k and v are rotated after RoPE, the output rotated back. rings:
    an integer cache's exact window (kernels/attention/kv_exact.py), used when meta.exact_rows is set."""
    exact = rings is not None and meta.exact_rows is not None
    if rotation is not None or exact:
        return _int_forward(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, meta,
                            softmax_scale, window, softcap, rotation, rings if exact else None)
    decode = meta.max_query_len == 1 and q.shape[0] == meta.block_tables.shape[0] and not meta.multi_token \
        and not meta.store_first and not is_int_cache(k_cache)        # the fused decode kernel is float / fp8
    full_rotary = cos_sin_cache.shape[1] == q.shape[-1]
    if meta.kv_observer is None and q.is_cuda and decode and full_rotary and q.shape[-1] & (q.shape[-1] - 1) == 0:
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            softmax_scale, k_scale, v_scale, new=NewTokens(k, v, positions, cos_sin_cache,
                                                                          meta.slot_mapping),
                            wide_table=meta.wide_table, merge=merge, window=window, softcap=softcap)
    if meta.kv_observer is None and full_rotary:
        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    else:
        q.copy_(apply_rope_ref(q, positions, cos_sin_cache))
        k.copy_(apply_rope_ref(k, positions, cos_sin_cache))
        if meta.kv_observer is not None:
            meta.kv_observer(k, v, k_scale, v_scale)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return attend(q, k_cache, v_cache, meta, softmax_scale, k_scale, v_scale, window, softcap)


def _rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] @ rotation [D, D], math in fp32, in x's dtype."""
    return (x.float() @ rotation).to(x.dtype)


def _int_forward(q, k, v, positions, cos_sin_cache, k_cache, v_cache, k_scale, v_scale, meta, softmax_scale,
                 window, softcap, rotation, rings) -> torch.Tensor:
    """An integer cache with a rotation and / or an exact window. Rotated: the cache holds K H and V H (H
    orthonormal and symmetric: a Hadamard matrix spreads a channel outlier over the whole head, so per-token groups
    quantize well): scores (q H)(k H)^T = q k^T, output (P V H) H = P V. Exact window: attention also reads this
    step's K/V and the rings, which take the step's K/V after it. On CUDA the RoPE, rotations and store are one
    kernel and the rotation back another (kernels/attention/kv_int_prologue.py); this torch sequence is their twin."""
    if fits(q, cos_sin_cache):
        q, k, v = int_prologue_triton(q, k, v, positions, cos_sin_cache, rotation is not None, k_cache, v_cache,
                                      meta.slot_mapping, k_scale, v_scale)
    else:
        q = apply_rope_ref(q, positions, cos_sin_cache)
        k = apply_rope_ref(k, positions, cos_sin_cache)
        if rotation is not None:
            q, k, v = _rotate(q, rotation), _rotate(k, rotation), _rotate(v, rotation)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    exact = None if rings is None else ExactWindow(k, v, rings[0], rings[1], meta.exact_rows)
    out = attend(q, k_cache, v_cache, meta, softmax_scale, k_scale, v_scale, window, softcap, exact)
    if exact is not None:
        write_ring(exact)
    if rotation is None:
        return out
    return rotate_triton(out) if out.is_cuda and out.stride(-1) == 1 else _rotate(out, rotation)   # hadamard(D)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           softmax_scale: float, k_scale=1.0, v_scale=1.0, window: int = 0, softcap: float = 0.0,
           exact: ExactWindow | None = None) -> torch.Tensor:
    """q: [T, Hq, D] (rotated) against the paged cache, which already holds this step's K/V. -> [T, Hq, D]"""
    d = meta.num_decodes
    if 0 < d < meta.block_tables.shape[0] and meta.prefill_query_start_loc is not None:
        # One query token per sequence costs the prefill kernel a whole [BLOCK_M, ctx] tile sweep per sequence;
        # the decode kernel reads each sequence's context once.
        head, tail = exact.split(d) if exact is not None else (None, None)
        out = torch.empty_like(q)
        out[:d] = paged_attention(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d],
                                  meta.query_start_loc[:d + 1], softmax_scale, k_scale, v_scale, window, softcap,
                                  exact=head)
        out[d:] = paged_attention(q[d:], k_cache, v_cache, meta.block_tables[d:], meta.seq_lens[d:],
                                  meta.prefill_query_start_loc, softmax_scale, k_scale, v_scale, window, softcap,
                                  exact=tail)
        return out
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           softmax_scale, k_scale, v_scale, window, softcap, multi_token=meta.multi_token,
                           wide_table=meta.wide_table, exact=exact)
