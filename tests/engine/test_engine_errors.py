"""Bad input gets a clear error that names the problem."""
import json
import shutil

import pytest

from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, make_engine


def _copy_config(model, tmp_path, **changes):
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, tmp_path / name)
    return tmp_path


def test_model_dir_without_weights(random_model, tmp_path):
    _copy_config(random_model, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*config\.json"):
        make_engine(tmp_path)


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_engine(tmp_path / "nope")


def test_truncated_safetensors(random_model, tmp_path):
    _copy_config(random_model, tmp_path)
    data = next(random_model.glob("*.safetensors")).read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        make_engine(tmp_path)


def test_unsupported_architecture(random_model, tmp_path):
    _copy_config(random_model, tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*supported: LlamaForCausalLM.*"
                                         "Qwen3ForCausalLM.*Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM"):
        make_engine(tmp_path)


def test_missing_tensor_is_named(random_model, tmp_path):
    from safetensors.torch import load_file, save_file
    _copy_config(random_model, tmp_path)
    tensors = {}
    for f in sorted(random_model.glob("*.safetensors")):
        tensors.update(load_file(f))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*model\.layers\.3\.mlp\.gate_up_proj \(shard 1\)"):
        make_engine(tmp_path)


def test_prompt_longer_than_max_model_len(random_model):
    engine = make_engine(random_model, max_model_len=64)
    with pytest.raises(ValueError, match="prompt has 80 tokens, but max_model_len is 64"):
        engine.add_request("long", list(range(3, 83)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [5, 99999], SamplingParams(max_tokens=4))
    vocab = engine.model_config.vocab_size            # the offline API checks logit_bias ids, as the server does
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
        engine.add_request("bias", [5, 6], SamplingParams(max_tokens=4, logit_bias={3: 1.0, vocab: 5.0}))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_max_model_len_above_model_limit(random_model):
    with pytest.raises(ValueError, match="exceeds the model.s limit of 2048 tokens"):
        make_engine(random_model, max_model_len=4096)


def test_generation_stops_at_max_model_len(random_model):
    engine = make_engine(random_model, max_model_len=40)
    out = engine.generate([list(range(3, 33))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert_all_blocks_free(engine)
