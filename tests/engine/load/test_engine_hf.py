"""The paged engine against Hugging Face transformers on the trained fixture (fp32 on CPU)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, make_engine

NEW_TOKENS = 12


def _prompts(tokenizer, text: str) -> list[list[int]]:
    """8 prompts of very different lengths (3..~150 tokens); two share a long system prompt."""
    ids = tokenizer.encode(text)
    system = tokenizer.apply_chat_template([{"role": "system", "content": "You are a dictionary. " * 6},
                                            {"role": "user", "content": 'What does "lantern" mean?'}],
                                           add_generation_prompt=True, tokenize=False)
    system2 = tokenizer.apply_chat_template([{"role": "system", "content": "You are a dictionary. " * 6},
                                             {"role": "user", "content": 'What does "harbor" mean?'}],
                                            add_generation_prompt=True, tokenize=False)
    return [ids[:3], ids[100:117], ids[300:333], ids[500:650], ids[1000:1064], ids[2000:2090],
            tokenizer.encode(system), tokenizer.encode(system2)]


@pytest.fixture(scope="module")
def hf_model(trained_model):
    return AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(trained_model):
    return AutoTokenizer.from_pretrained(str(trained_model))


@pytest.fixture(scope="module")
def prompts(tokenizer, heldout_text):
    return _prompts(tokenizer, heldout_text)


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompts):
    outputs = []
    for ids in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, attention_mask=torch.ones(1, len(ids)))
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_hf_staggered_chunked(prefix_caching, trained_model, prompts, hf_greedy):
    engine = make_engine(trained_model, chunk=32, prefix_caching=prefix_caching)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        # staggered arrivals: a new request joins every other step while others are mid-prefill or decoding
        if pending and steps % 2 == 0:
            i, ids = pending.pop(0)
            engine.add_request(f"r{i}", ids, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        steps += 1
    for i, expected in enumerate(hf_greedy):
        assert results[f"r{i}"] == expected, f"prompt {i} ({len(prompts[i])} tokens) diverged from transformers"
    if prefix_caching:
        # the two chat prompts share their system prompt: the second one must have hit the cache
        assert engine.block_manager.prefix_hits >= 16
    assert_all_blocks_free(engine)


def test_full_logits_match_hf(hf_model, trained_model, prompts):
    engine = make_engine(trained_model, chunk=48)
    ids = prompts[3]
    ours = engine.score(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert_all_blocks_free(engine)


def test_generate_blocking_api_and_text(trained_model, tokenizer, prompts):
    engine = make_engine(trained_model)
    outs = engine.generate([tokenizer.decode(prompts[6])],
                           SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0))
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].text == tokenizer.decode(outs[0].outputs[0].token_ids, skip_special_tokens=True)
    assert_all_blocks_free(engine)
