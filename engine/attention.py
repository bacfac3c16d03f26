"""Per-step attention metadata and the call into the paged-attention kernels (Triton on CUDA, torch twin on CPU)."""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention_ref import apply_rope_ref
from kernels.paged_attention import paged_attention, rope_store_kv, store_kv


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: cache slot of each new token, -1 = padding (not stored)
    block_tables: torch.Tensor      # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor          # [B] int32: context length per sequence including its new tokens
    query_start_loc: torch.Tensor   # [B+1] int32: sequence b owns tokens [query_start_loc[b], query_start_loc[b+1])
    max_seq_len: int
    max_query_len: int
    # Calibration hook: called with (k, v, k_scale, v_scale) of each layer before the store; may set the scales.
    kv_observer: Callable | None = None


def paged_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale,
                            v_scale, meta: AttentionMetadata, softmax_scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] before RoPE; positions [T]; cos_sin_cache [max_pos, D].
    Rotates q and k in place, stores k/v by slot_mapping (one fused kernel on CUDA), then attends. -> [T, Hq, D]"""
    if meta.kv_observer is None:
        rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    else:
        q.copy_(apply_rope_ref(q, positions, cos_sin_cache))
        k.copy_(apply_rope_ref(k, positions, cos_sin_cache))
        meta.kv_observer(k, v, k_scale, v_scale)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                               softmax_scale, k_scale, v_scale)
