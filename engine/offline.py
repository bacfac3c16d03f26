"""Offline use of an engine: blocking generation of a list of prompts, and scoring (logits at every position)."""
import torch
from tqdm import tqdm

from quant_serve.engine.outputs import RequestOutput
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.lora import manager as lora


def generate(engine, prompts: list[str | list[int]] | str, params: SamplingParams | list[SamplingParams] | None
             = None, use_tqdm: bool = False) -> list[RequestOutput]:
    """Blocking batch generation; results in prompt order."""
    if isinstance(prompts, str):
        prompts = [prompts]
    params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    ids = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        request_id = f"generate-{id(prompts)}-{i}"
        engine.add_request(request_id, prompt, p)
        ids.append(request_id)
    final: dict[str, RequestOutput] = {}
    bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
    while len(final) < len(ids):
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
                bar.update(1)
    bar.close()
    return [final[i] for i in ids]


def score(engine, token_ids: list[int], lora_name: str | None = None) -> torch.Tensor:
    """Logits at every position of `token_ids` through the paged path, in chunks of the token budget:
    [len, vocab] fp32 on the CPU, under the LoRA adapter lora_name if given. Used by eval; call it while no requests
    are running."""
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens exceed max_model_len {engine.max_model_len}")
    if engine.requests:
        raise RuntimeError(f"score() needs an idle engine; {len(engine.requests)} requests are unfinished")
    engine.drain()                        # a step that ran ahead for requests that have since finished
    seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=None),
                   lora_id=lora.lora_id(engine.lora, lora_name))
    chunk = engine.config.scheduler.max_num_batched_tokens
    pieces = []
    try:
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if not engine.block_manager.allocate_slots(seq, n):
                raise RuntimeError("KV cache too small to score this sequence")
            swap_in, swap_out = engine.block_manager.take_swaps()      # prefix blocks evicted to the CPU tier
            out = SchedulerOutput([ScheduledSeq(seq, n)], n, [], engine.block_manager.take_copies(), swap_in,
                                  swap_out)
            engine.count_transfers(out)
            pieces.append(engine.runner.compute_all_logits(out).cpu())
            seq.num_computed_tokens += n
    finally:
        engine.block_manager.free(seq)
    return torch.cat(pieces)
