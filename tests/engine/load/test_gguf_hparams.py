"""engine/load/gguf/hparams.py on hand-made metadata: what the GGUF says that transformers' mapping leaves out."""
from types import SimpleNamespace

import pytest

from quant_serve.engine.load.gguf.hparams import apply_gguf_hparams, end_of_generation_ids


def _hf():
    return SimpleNamespace(hidden_size=256, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=4096)


def test_linear_rope_scaling_is_carried():
    hf = _hf()
    apply_gguf_hparams(hf, "llama", {"llama.rope.freq_base": 500000.0, "llama.rope.scaling.type": "linear",
                                     "llama.rope.scaling.factor": 4.0}, {})
    assert hf.rope_parameters == {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_unsupported_rope_scaling_is_refused(kind):
    """A YaRN GGUF (or a LongRoPE one without its factor tensors) was loaded as plain rope: wrong logits, no error."""
    meta = {"qwen2.rope.scaling.type": kind, "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    with pytest.raises(ValueError, match=f"rope scaling '{kind}'.*not supported"):
        apply_gguf_hparams(_hf(), "qwen2", meta, {})


def test_end_of_turn_tokens_stop_generation(tmp_path):
    """A Gemma GGUF's eos is <eos> while its chat turns end with <end_of_turn>: the file's eot / eom ids and the
    control tokens spelled like an end of turn stop generation too (as in llama.cpp); a normal token of that
    spelling does not."""
    import gguf
    tokens = ["<pad>", "<eos>", "<end_of_turn>", "hello", "<|im_end|>", "<EOT>", "<start_of_turn>", "<|eom_id|>"]
    types = [3, 3, 3, 1, 4, 1, 3, 1]
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "gemma2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_eos_token_id(1)
    writer.add_uint32("tokenizer.ggml.eom_token_id", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert end_of_generation_ids(gguf.GGUFReader(str(tmp_path / "vocab.gguf"))) == [2, 4, 7]
