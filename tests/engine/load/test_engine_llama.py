"""A random-weight Llama (untied head, llama3 rope scaling, GQA 4:1) built in the test, against transformers."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quant_serve.engine.sampling_params import SamplingParams
from fixtures import copy_tokenizer
from helpers import assert_all_blocks_free, make_engine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=8192, hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, bos_token_id=0, eos_token_id=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float16)
    with torch.no_grad():  # larger weights than the default init so that tokens differ from position to position
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path), max_shard_size="1MB")   # sharded with an index
    copy_tokenizer(path)
    return path


def test_llama_logits_and_greedy_match_hf(llama_dir):
    assert (llama_dir / "model.safetensors.index.json").is_file()
    ref_model = LlamaForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    assert ref_model.config.rope_parameters["rope_type"] == "llama3"
    engine = make_engine(llama_dir, chunk=40)
    assert engine.model.lm_head is not None
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 8192, (150,), generator=gen).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.score(ids), ref, atol=3e-4, rtol=1e-4)

    prompts = [ids[:5], ids[:77], ids[20:150]]
    params = SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = ref_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                          min_new_tokens=10, attention_mask=torch.ones(1, len(prompt)))
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
    assert_all_blocks_free(engine)
