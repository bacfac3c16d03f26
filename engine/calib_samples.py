"""Calibration text sampled from the model itself ("self-calibration", no corpus needed): `quant-serve quantize`'s
default calibration when no --calib file is given, and `quant-serve make-calib --samples-from`'s documents.

The default window count and length depend on the device: on the CPU, sampling and the calibrated search both cost
time in proportion to the tokens, and fewer tokens measured as accurate on the fixture
(bench/results/default-calib-cpu-tiny-qwen2.json); the GPU keeps the 128 x 512 windows AutoAWQ uses.
"""
import gc
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from quant_serve.quant.calib import EOT


@dataclass(frozen=True)
class CalibWindows:
    count: int                        # windows (sequences)
    length: int                       # tokens per window, the start token included


GPU_WINDOWS = CalibWindows(128, 512)
CPU_WINDOWS = CalibWindows(64, 128)


def default_windows(device: str) -> CalibWindows:
    """The sampled calibration's size when --calib-samples / --calib-seq-len are not given."""
    return GPU_WINDOWS if torch.device(device).type == "cuda" else CPU_WINDOWS


def start_token(tok) -> int:
    """Where a sampled document starts: BOS (Llama), else the document separator <|endoftext|> (Qwen), else EOS."""
    if tok.bos_token_id is not None:
        return tok.bos_token_id
    if EOT in tok.get_vocab():
        return tok.convert_tokens_to_ids(EOT)
    if tok.eos_token_id is not None:
        return tok.eos_token_id
    raise ValueError("the tokenizer has no BOS, <|endoftext|> or EOS token to start sampled calibration text "
                     "from; pass --calib FILE")


def sample_token_windows(model_dir: str | Path, count: int, length: int, seed: int = 0, device: str = "auto",
                         show_progress: bool = True) -> tuple[torch.Tensor, object]:
    """count windows of `length` token ids: the start token, then length - 1 tokens sampled from the model at
    temperature 1 (no top-k / top-p, EOS ignored), each window with its own seed drawn from `seed`.
    -> ([count, length] int64, tokenizer). Deterministic for a given seed, torch build and device; window i does
    not depend on count, and a shorter length gives a prefix of the same window."""
    from quant_serve.engine.config import BLOCK_SIZE, CacheConfig, EngineConfig, SchedulerConfig
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.engine.sampling_params import SamplingParams
    if count < 1 or length < 2:
        raise ValueError(f"calibration needs at least one window of two tokens, got {count} x {length}")
    blocks = count * -(-length // BLOCK_SIZE)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, enforce_eager=True, max_model_len=length,
                                    cache=CacheConfig(num_gpu_blocks=blocks),
                                    scheduler=SchedulerConfig(max_num_seqs=count)), show_progress=False)
    tok = engine.tokenizer
    start = start_token(tok)
    rng = random.Random(seed)
    ids = [f"calib-{i}" for i in range(count)]
    for request_id in ids:
        engine.add_request(request_id, [start], SamplingParams(max_tokens=length - 1, temperature=1.0,
                                                                seed=rng.randrange(2**31), ignore_eos=True))
    # counted in tokens: every window advances one token a step and all of them finish in the last step
    sampled = {request_id: [] for request_id in ids}
    finished = 0
    with tqdm(total=count * (length - 1), desc="Sampling calibration", unit="tok", disable=not show_progress) as bar:
        while finished < count:
            for output in engine.step():
                tokens = output.outputs[0].token_ids
                bar.update(len(tokens) - len(sampled[output.request_id]))
                sampled[output.request_id] = list(tokens)
                finished += output.finished
    windows = torch.tensor([[start, *sampled[i]] for i in ids], dtype=torch.int64)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()            # the FP16 model and its KV cache go back before quantizing
    return windows, tok


def model_samples(model_dir: str, count: int, length: int, seed: int = 0, device: str = "auto") -> list[str]:
    """Documents sampled from the model, decoded with their special tokens (make-calib --samples-from)."""
    windows, tok = sample_token_windows(model_dir, count, length + 1, seed, device)
    return [tok.decode(w[1:].tolist(), skip_special_tokens=False) for w in windows]
