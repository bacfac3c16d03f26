"""Throwaway forwards at start over the step shapes serving meets, so that Triton compiles (and cuBLAS and the
allocator settle) before the first request instead of inside its time to first token."""
import torch
from tqdm import tqdm

from quant_serve.engine.worker.attention import AttentionMetadata
from quant_serve.kernels.argmax import argmax_rows
from quant_serve.kernels.attention.merge import DecodePartials, merge_partials
from quant_serve.kernels.attention.paged import MAX_SPLITS, store_kv


@torch.inference_mode()
def warm_up(runner, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
           show_progress: bool = False) -> int:
    """Throwaway forwards over the step shapes serving meets: a full-budget prompt chunk, short prompts in every
    W4A16 dispatch band, decodes (few and many, short and long contexts) alone and mixed with a chunk. Triton
    then compiles (and cuBLAS and the allocator settle) before the first request instead of inside its time to
    first token. Stores nothing (every slot is -1) and leaves the first-forward KV-scale calibration to the
    first real step. -> forwards run"""
    budget = max_num_batched_tokens
    shapes: list[tuple[list[int], list[int]]] = [([], [budget])]          # (decode contexts, prompt chunks)
    # prompt chunks in every band of the W4A16 dispatch (kernels/matmul/rules.py), each at a multiple of 16
    # rows and off one (Triton compiles an integer argument's divisibility by 16 into the kernel)
    shapes += [([], [t]) for t in (1, 3, 8, 16, 24, 40, 48, 64, 100, 128, 200, 300, 512, 1000) if t < budget]
    decodes = min(max_num_seqs, 64, budget)
    if max_num_seqs > 1 and budget > 3:
        shapes.append(([max_model_len // 2] * min(3, decodes, max_num_seqs - 1), [budget - 3]))
    # decode batches that reach every branch of the decode rule (kernels/attention/paged.decode_config: one
    # sequence, just past 8 programs, many; contexts that split or not, tables that take asm-widened fp8 tiles
    # or not), alone and beside a chunk (mixed steps run them eagerly, without the folded RoPE)
    few = 8 // runner.model_config.num_kv_heads + 1
    for d in sorted({1, min(few, decodes), decodes}):
        for ctx in sorted({min(32, max_model_len), min(512, max_model_len), max_model_len // 2}):
            shapes.append(([ctx] * d, []))
            if max_num_seqs > d and budget > d + 16:
                shapes.append(([ctx] * d, [16]))
    for contexts, chunks in tqdm(shapes, desc="Warming up", unit="step", disable=not show_progress):
        chunks = [min(c, max_model_len) for c in chunks]
        _warm_up_forward(runner, contexts, chunks)
    # the first real step may hand its K/V to the scale calibration, which stores them through store_kv
    attn, cfg = runner.model.attention_layers[0], runner.model_config
    kv = torch.zeros((1, cfg.num_kv_heads, cfg.head_dim), dtype=runner.dtype, device=runner.device)
    store_kv(kv, kv, attn.k_cache, attn.v_cache, torch.full((1,), -1, dtype=torch.long, device=runner.device),
             attn.k_scale, attn.v_scale)
    _warm_up_split_merges(runner)
    return len(shapes)

def _warm_up_split_merges(runner) -> None:
    """The merge of an eager decode's context splits (mixed steps) is compiled per power of two of splits; the
    warm-up contexts reach only some of the counts the decode rule gives on this GPU (they follow its SM count),
    so every one up to MAX_SPLITS is compiled here. (The CPU path merges with the torch twin: nothing to do.)"""
    if runner.device.type != "cuda":
        return
    cfg, dev, attn = runner.model_config, runner.device, runner.model.attention_layers[0]
    block_d = 1 << (cfg.head_dim - 1).bit_length()
    out = torch.empty((1, cfg.num_heads, cfg.head_dim), dtype=runner.dtype, device=dev)
    for splits in (1 << i for i in range(1, MAX_SPLITS.bit_length())):
        merge_partials(DecodePartials(
            torch.zeros((1, cfg.num_heads, splits, block_d), dtype=torch.float32, device=dev),
            torch.zeros((1, cfg.num_heads, splits, 2), dtype=torch.float32, device=dev),
            torch.ones(1, dtype=torch.int32, device=dev), torch.tensor([0, 1], dtype=torch.int32, device=dev),
            out, 64, attn.v_scale if runner.kv_is_fp8 else None))

def _warm_up_forward(runner, contexts: list[int], chunks: list[int]) -> None:
    q_lens = [1] * len(contexts) + chunks
    seq_lens = contexts + chunks
    positions = [c - 1 for c in contexts] + [p for c in chunks for p in range(c)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    d = len(contexts) if contexts and chunks else 0
    num_tokens = starts[-1]
    max_blocks = -(-max(seq_lens) // runner.block_size)
    dev = runner.device
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
        block_tables=torch.zeros((len(q_lens), max_blocks), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        max_seq_len=max(seq_lens), max_query_len=max(q_lens), num_decodes=d,
        prefill_query_start_loc=torch.tensor([x - d for x in starts[d:]], dtype=torch.int32, device=dev)
        if d else None)
    lora = getattr(runner, "lora", None)
    if lora is not None:        # every row on slot 0: the adapters' kernels compile here, not at a first request
        lora.batch.slots = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
    hidden = runner.model(torch.zeros(num_tokens, dtype=torch.long, device=dev),
                        torch.tensor(positions, dtype=torch.long, device=dev), meta)
    if lora is not None:
        lora.batch.slots = None
    argmax_rows(runner.model.compute_logits(hidden[[s - 1 for s in starts[1:]]], float32=False))   # greedy rows
