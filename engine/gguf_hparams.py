"""The GGUF hyper-parameters transformers' GGUF config mapping leaves out, set on its config before ModelConfig is
made from it: head_dim (attention.key_length: Qwen3-0.6B's 128 is not hidden / heads), Gemma 2's soft-caps,
Gemma's attention scale as llama.cpp computes it, partial rotary (rope.dimension_count), linear rope scaling,
Phi-3's LongRoPE factors and llama 3's rope frequency factors (both stored as tensors by llama.cpp's converter)."""
import numpy as np


def metadata(reader) -> dict:
    """The fields of a GGUFFile (engine/gguf_file.py) or GGUFReader -> {key: value}, the tokenizer's arrays left
    out."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        try:
            out[key] = field.contents()
        except Exception:          # a field type the reader cannot turn into Python: not one we read
            continue
    return out


# Tokens that end generation where the vocabulary has them as control tokens, besides the file's eos / eot / eom
# ids, as llama.cpp decides: a chat template's turn end is often not the file's eos (Gemma's <end_of_turn>).
END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                     "<|end_of_text|>", "<EOT>", "<|return|>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
_CONTROL_TYPES = (3, 4)              # gguf.TokenType CONTROL, USER_DEFINED


def end_of_generation_ids(reader) -> list[int]:
    """The file's eot / eom ids and its control tokens spelled like an end of turn or of text, in id order."""
    ids = {int(reader.fields[key].contents()) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if key in reader.fields}
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        control = [i for i, t in enumerate(types.contents()) if t in _CONTROL_TYPES]
        # one string at a time: the whole vocabulary as Python strings costs ~0.3 s on a 150k-token file
        ids |= {i for i in control if tokens.contents(i) in END_OF_GENERATION}
    return sorted(ids)


def _vector(tensors: dict, name: str) -> list[float] | None:
    t = tensors.get(name)
    return None if t is None else np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()


def apply_gguf_hparams(hf, arch: str, meta: dict, tensors: dict) -> None:
    """Set on the transformers config `hf` what the GGUF metadata `meta` and tensor table say that transformers'
    GGUF mapping does not carry over."""
    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    head_dim = get("attention.key_length")
    if head_dim:
        hf.head_dim = int(head_dim)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    theta = float(get("rope.freq_base", getattr(hf, "rope_theta", None) or 10000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    rotary = get("rope.dimension_count")
    if rotary and int(rotary) < head_dim:
        rope["partial_rotary_factor"] = int(rotary) / head_dim
        hf.partial_rotary_factor = int(rotary) / head_dim
    scaling_type = str(get("rope.scaling.type", "none") or "none")
    long, short = _vector(tensors, "rope_factors_long.weight"), _vector(tensors, "rope_factors_short.weight")
    if scaling_type not in ("none", "linear") and not (scaling_type == "longrope" and long is not None):
        # YaRN & co. change every position's rotation: dropping them would serve wrong logits without a word
        raise ValueError(f"GGUF rope scaling {scaling_type!r} ({arch}.rope.scaling.type) is not supported "
                         "(supported: none, linear, LongRoPE factors, llama 3 rope_freqs)")
    if scaling_type == "linear" and get("rope.scaling.factor"):
        rope |= {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if long is not None and short is not None:                          # Phi-3 LongRoPE
        rope |= {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                 "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                              hf.max_position_embeddings))}
        if get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(get("rope.scaling.attn_factor"))
    freqs = _vector(tensors, "rope_freqs.weight")
    if freqs is not None:                                                # llama 3: inv_freq / factor per pair
        rope |= {"rope_type": "freq_factors", "factors": freqs}
    if arch in ("gemma2", "gemma3"):
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                setattr(hf, key, float(get(key)))
        # attention.scale where the file has it; else as llama.cpp: head_dim ** -0.5, but (hidden / heads) ** -0.5
        # for the 27B models
        big = hf.num_hidden_layers == (46 if arch == "gemma2" else 62)
        hf.query_pre_attn_scalar = hf.hidden_size // hf.num_attention_heads if big else head_dim
        if get("attention.scale"):
            hf.query_pre_attn_scalar = float(get("attention.scale")) ** -2
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
        hf.rope_parameters = {"full_attention": rope, "sliding_attention": local}
    else:
        hf.rope_parameters = rope
