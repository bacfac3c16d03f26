"""GPU machine only (skipped on CPU): GGUF files of the trained tiny model on the CUDA path (W4A16 with float offsets,
W8A16, CUDA graphs) against the CPU path's exact fp32 scoring, and the dummy Q4_K_M mix of a 7B-shaped config."""
import math

import pytest
import torch

from conftest import QWEN_7B
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from gguf_fixtures import write_gguf
from helpers import assert_all_blocks_free, make_engine

pytestmark = pytest.mark.gpu


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1].double().cpu(), dim=-1)
    return float(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean())


@pytest.mark.parametrize("mix", ["Q4_0", "Q4_K_M", "Q5_K_M"])
def test_cuda_gguf_matches_cpu(tmp_path, mix, trained_model, heldout_text):
    path = write_gguf(trained_model, tmp_path / f"tiny-{mix}.gguf", mix)
    cpu = make_engine(path, dtype="float32", num_blocks=64, max_model_len=512)
    gpu = make_engine(path, dtype="float16", device="cuda", num_blocks=64, max_model_len=512)
    ids = cpu.tokenizer.encode(heldout_text[:6000])[:384]
    # fp16 activations and fp16 scales/offsets (Q4_K's fp32 products rounded) against exact fp32: close perplexity
    ppl_cpu, ppl_gpu = math.exp(_nll(cpu.score(ids), ids)), math.exp(_nll(gpu.score(ids), ids))
    assert abs(ppl_gpu / ppl_cpu - 1) < 5e-3, (ppl_cpu, ppl_gpu)
    from quant_serve.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0)
    prompts = [ids[i:i + 16] for i in range(0, 128, 16)]
    ref = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    assert agree >= 0.9, f"only {agree:.0%} of greedy tokens agree between CUDA and CPU"
    assert_all_blocks_free(gpu)


MERGED = "merged Q4_K / Q5_K + Q6_K (each run of shards in its own layout, outputs concatenated)"
Q6K = "Q6_K (6-bit: W4A16 fragment layout, 7 bits, on CUDA fp16; else W8A16 kernels, planes, 6.5625 bits)"


@pytest.mark.parametrize("mix,paths", [
    ("Q4_K_M", f"84 INT4 Q4_K (W4A16, two-level scales, 4.625 bits), 14 {MERGED}, 15 {Q6K}"),
    ("Q5_K_M", f"14 {MERGED}, 84 Q5_K (5-bit: W4A16 fragment layout, 6 bits, on CUDA fp16; else W8A16 kernels, planes, 5.625 bits), 15 {Q6K}")])
def test_cuda_dummy_q4_k_m_7b_shape(mix, paths):
    config = QWEN_7B
    engine = make_engine(config, dtype="float16", device="cuda", num_blocks=64, max_model_len=512,
                         load_format="dummy", quantization=f"gguf:{mix}", tokenizer=str(DEMO_MODEL_DIR))
    # 28 layers: v and down Q6_K in 14 of them (qkv in parts: q / k in the base type's layout, v 6-bit planes;
    # down 6-bit planes) and the head (6-bit planes), the rest the base type (Q4_K INT4 / Q5_K planes, two-level)
    assert engine.quant_config.describe_paths() == paths
    from quant_serve.engine.sampling_params import SamplingParams
    out = engine.generate([list(range(100, 132))], SamplingParams(max_tokens=16, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 16
