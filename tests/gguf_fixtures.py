"""GGUF files the tests write themselves from an FP16 safetensors model (tiny-qwen2) with gguf.GGUFWriter: the
metadata llama.cpp's converter writes (hyper-parameters, the BPE tokenizer, the chat template) and each matrix in
the type a mix gives it. Q4_0 / Q4_1 / Q5_0 / Q8_0 through gguf.quants.quantize, the K-quants through
quant/formats/gguf/kquants.py. `llama_permute` applies llama.cpp's q / k row order for the llama architecture."""
import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from quant_serve.quant.formats.gguf.config import q4_k_m_type
from quant_serve.quant.formats.gguf.kquants import quantize

_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0, T.Q5_K: T.Q5_1}   # llama.cpp's choice for rows not a multiple of 256


def mix_type(mix: str, hf_name: str, num_layers: int, k: int) -> T:
    """The type a mix gives a matrix (HF name, e.g. model.layers.3.mlp.down_proj.weight) of K inputs."""
    prefix = hf_name.removesuffix(".weight").replace("model.embed_tokens", "token_embd")
    if mix in ("Q4_K_M", "Q5_K_M"):
        base = T.Q4_K if mix == "Q4_K_M" else T.Q5_K
        qtype = base if prefix == "token_embd" else q4_k_m_type(prefix, num_layers, base)
        return _FALLBACK[qtype] if k % 256 else qtype
    return {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "F16": T.F16}[mix]


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(writer, model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    if len(vocab) != config["vocab_size"]:
        return                            # a random model with a smaller vocabulary: no tokenizer in the file
    added = {a["id"]: a["content"] for a in tok["added_tokens"]}
    size = config["vocab_size"]
    tokens = [""] * size
    for text, i in vocab.items():
        tokens[i] = text
    for i, text in added.items():
        tokens[i] = text
    for i in range(size):
        tokens[i] = tokens[i] or f"[PAD{i}]"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in added else (5 if tokens[i].startswith("[PAD") else 1) for i in range(size)])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = {v: k for k, v in added.items()}
    writer.add_eos_token_id(ids[tcfg["eos_token"]])
    writer.add_pad_token_id(ids[tcfg["pad_token"]])
    writer.add_bos_token_id(config.get("bos_token_id") or 0)
    writer.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def write_gguf(model_dir: Path, out: Path, mix: str, arch: str = "qwen2", split_max_tensors: int = 0) -> Path:
    """The safetensors model in model_dir -> one GGUF file `out` with the type mix (Q4_0, Q4_1, Q8_0, F16,
    Q4_K_M). arch "llama" permutes q / k rows as llama.cpp does (the model must then have no q / k bias).
    split_max_tensors > 0: split files NAME-0000i-of-0000N.gguf of at most that many tensors each."""
    import gguf
    from safetensors.torch import load_file
    config = json.loads((model_dir / "config.json").read_text())
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_name(model_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if arch != "gemma3":                  # gemma3: its global layers' base, in _arch_metadata
        writer.add_rope_freq_base((config.get("rope_parameters") or {}).get("rope_theta",
                                                                            config.get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    _tokenizer(writer, model_dir, config)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    extra = _arch_metadata(writer, arch, config, head_dim)
    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    for hf_name in sorted(weights, key=_natural):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        w = weights[hf_name].to(torch.float32).numpy()
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        if arch in ("gemma2", "gemma3") and base.endswith("norm"):
            w = w + 1.0                                      # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            w = llama_permute(w, heads if base.endswith("q_proj") else kv_heads)
        if w.ndim == 1:
            writer.add_tensor(name, w.astype(np.float32))
            continue
        qtype = mix_type(mix, hf_name, layers, w.shape[1])
        if qtype == T.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    for name, value in extra.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _arch_metadata(writer, arch: str, config: dict, head_dim: int) -> dict[str, np.ndarray]:
    """The per-family keys llama.cpp's converter writes; -> the extra tensors it writes (rope factors)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf_rope_type("linear"))
            writer.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        rotary = int(head_dim * (rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0))
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(config.get("original_max_position_embeddings")
                                             or rope["original_max_position_embeddings"])
        return {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
                "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        return {"rope_freqs.weight": _llama3_freq_factors(rope, head_dim)}
    return {}


def gguf_rope_type(name: str):
    import gguf
    return gguf.RopeScalingType(name)


def _llama3_freq_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for llama 3 scaling: the divisor of each inverse frequency."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
