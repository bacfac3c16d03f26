"""Small random-weight models of each architecture family, built from its transformers config: Qwen3, Gemma 2,
Gemma 3, Phi-3 (and Phi-4-mini's partial rotary) and Llama 3.2 (tied head). conftest.arch_models saves them once
per session; tests compare our engine and quantizers against transformers on them."""
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, Phi3Config,
                          Qwen3Config)

from fixtures import copy_tokenizer

VOCAB = 4096
SMALL = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, bos_token_id=0, eos_token_id=2, pad_token_id=0)
WINDOW = 24          # Gemma's sliding window here: the 150-token prompt and the 40-token chunks cross it

CONFIGS = {
    "qwen3": lambda: Qwen3Config(**SMALL, num_hidden_layers=3, head_dim=48, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, rope_theta=1000000.0),
    "gemma2": lambda: Gemma2Config(**SMALL, num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=48,
                                   sliding_window=WINDOW, attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL, num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=40, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": lambda: Phi3Config(
        **SMALL, num_hidden_layers=3, original_max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(16)],
                      "long_factor": [2.0 + i / 4 for i in range(16)]}),
    "phi4-mini": lambda: Phi3Config(                    # partial rotary (3/4 of head_dim), tied head
        **SMALL, num_hidden_layers=2, original_max_position_embeddings=256, tie_word_embeddings=True,
        partial_rotary_factor=0.75, rope_scaling={"type": "longrope", "short_factor": [1.0] * 12,
                                                  "long_factor": [3.0] * 12}),
    "llama3.2": lambda: LlamaConfig(
        **SMALL, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}),
}


def random_model_dir(name: str, path, overrides: dict | None = None):
    """CONFIGS[name] (with `overrides` set on it) as a seeded random-weight checkpoint with tiny-qwen2's tokenizer
    in `path`: weights N(0, 0.08), norms around their identity (0 for Gemma's 1 + w, else 1)."""
    config = CONFIGS[name]()
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in pname:
                p.normal_(0.0 if "gemma" in name else 1.0, 0.2)
    model.save_pretrained(str(path))
    copy_tokenizer(path)
    return path


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def prompts() -> list[list[int]]:
    ids = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[:5], ids[:77], ids[20:150]]
