"""The GGUF path of each architecture: a small random-weight model (random_archs.CONFIGS) written as an F16
GGUF the way llama.cpp's converter writes it (Gemma's norms as 1 + w, llama's q/k row order, Phi-3's LongRoPE
factors and llama 3's rope frequencies as tensors, head_dim as key_length) loads into the model the safetensors
checkpoint gives: the same logits up to the F16 rounding of the weights."""
import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR

from gguf_fixtures import write_gguf
from helpers import make_engine
from random_archs import prompts, random_model_dir

GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "llama3.2": "llama"}
# What a GGUF cannot say, as real models have it: llama.cpp scales Gemma's queries by head_dim ** -0.5 (but for the
# 27B models) and hard-codes Gemma 3's five sliding layers to one global one.
GGUF_FAITHFUL = {"gemma2": {"query_pre_attn_scalar": 64},
                 "gemma3": {"query_pre_attn_scalar": 64, "num_hidden_layers": 6,
                            "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}


def _model_dir(name: str, path):
    return random_model_dir(name, path, GGUF_FAITHFUL.get(name))


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_f16_gguf_matches_safetensors(tmp_path, name):
    src = _model_dir(name, tmp_path / name)
    path = write_gguf(src, tmp_path / f"{name}.gguf", "F16", arch=GGUF_ARCH[name])
    ids = prompts()[1]
    kw = dict(num_blocks=16, max_model_len=256, tokenizer=str(DEMO_MODEL_DIR))
    ref_engine, engine = make_engine(src, **kw), make_engine(path, **kw)
    ref_cfg, cfg = ref_engine.model_config, engine.model_config
    for field in ("architecture", "head_dim", "layer_windows", "query_pre_attn_scalar", "attn_logit_softcap",
                  "final_logit_softcap", "rope_theta", "local_rope_theta", "rotary_dim", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(ref_cfg, field), field
    reference, logits = ref_engine.score(ids), engine.score(ids)
    # F16 weights of an fp32 model (and Gemma's 1 + w - 1): close, not equal; a wrong hyper-parameter is far off
    err = float((logits - reference).abs().max() / reference.abs().max())
    assert err < 1e-2, err
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95
