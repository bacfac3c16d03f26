"""transformers config -> ModelConfig: the fields our decoder reads, for Llama, Qwen2/3, Mistral, Gemma 2/3 and
Phi-3, from config.json (engine/loader.py) or a GGUF's metadata (engine/gguf_loader.py)."""
from pathlib import Path

import torch

from quant_serve.engine.checkpoint import check_model_config, check_size, read_json_object
from quant_serve.engine.config import ModelConfig

DTYPES = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float": torch.float32}


def model_config_from_hf(hf, arch: str, raw: dict, config_file: Path, model_dir: Path | None) -> ModelConfig:
    """A transformers config (from config.json or a GGUF's metadata) -> ModelConfig; raw: config.json's dict."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    local_rope = rope.get("sliding_attention")          # Gemma 3: one rope per layer type
    rope = dict(rope.get("full_attention", rope))
    theta, scaling = _rope(rope, getattr(hf, "rope_theta", 10000.0), getattr(hf, "rope_scaling", None))
    # a GGUF's metadata reaches here unchecked; 0 must not fall back to a default (`or`) or divide below
    for name in ("hidden_size", "num_attention_heads"):
        check_size(name, getattr(hf, name, None), config_file)
    for name in ("num_key_value_heads", "head_dim"):
        if getattr(hf, name, None) is not None:
            check_size(name, getattr(hf, name), config_file)
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None)) or 1.0
    eos = hf.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    gen_file = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen_file is not None and gen_file.is_file():
        gen_eos = read_json_object(gen_file).get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        eos = tuple(dict.fromkeys([*eos, *gen_eos]))
    dtype = getattr(hf, "dtype", None) or raw.get("torch_dtype") or "float16"
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype, torch.float16)
    cfg = ModelConfig(
        architecture=arch, model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        hidden_act=getattr(hf, "hidden_activation", None) or hf.hidden_act,
        eos_token_ids=eos, bos_token_id=getattr(hf, "bos_token_id", None), torch_dtype=dtype,
        quantization_config=raw.get("quantization_config"), layer_windows=_layer_windows(hf),
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
        **_family_fields(arch, hf, local_rope))
    check_model_config(cfg, config_file, getattr(hf, "head_dim", None) is not None)
    return cfg


def _rope(rope: dict, theta: float, scaling: dict | None) -> tuple[float, dict | None]:
    """rope_parameters (or the older rope_theta / rope_scaling) -> (base, scaling or None for plain rope)."""
    theta = rope.get("rope_theta", theta)
    scaling = rope if rope.get("rope_type", "default") != "default" else scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def _layer_windows(hf) -> tuple[int, ...]:
    """Each layer's sliding window (0: global): from layer_types where the config has them (Gemma 2/3, Qwen2/3
    with use_sliding_window), else the one window on every layer (Mistral, Phi-3); () when no layer slides.
    transformers' Qwen2/3 configs already drop sliding_window unless use_sliding_window is set."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    types = getattr(hf, "layer_types", None)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types) if types else \
        (window,) * hf.num_hidden_layers
    return windows if any(windows) else ()


def _family_fields(arch: str, hf, local_rope: dict | None) -> dict:
    """The ModelConfig fields that set Qwen3, Gemma 2/3 and Phi-3 apart from the Llama block."""
    if arch == "Qwen3ForCausalLM":
        return {"qk_norm": True}
    if arch == "Phi3ForCausalLM":
        return {"fused_checkpoint": True}
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    fields = {"gemma_norm": True, "sandwich_norms": True, "embed_scale": hf.hidden_size ** 0.5,
              "query_pre_attn_scalar": float(hf.query_pre_attn_scalar),
              "final_logit_softcap": float(getattr(hf, "final_logit_softcapping", None) or 0.0)}
    if arch == "Gemma2ForCausalLM":       # Gemma 3's attention ignores attn_logit_softcapping (as transformers)
        return fields | {"attn_logit_softcap": float(getattr(hf, "attn_logit_softcapping", None) or 0.0)}
    fields["qk_norm"] = True
    if local_rope is not None:
        fields["local_rope_theta"], fields["local_rope_scaling"] = _rope(dict(local_rope), 10000.0, None)
    return fields
