"""Weight bytes of a GGUF model as quant-serve holds it, by tensor type, without loading a weight: from a file's
tensor table, or from a config and a type mix (--load-format dummy --quantization gguf:Q4_K_M).

As the GPU holds them (quant/formats/gguf/types.py, the kernels' layouts): a layer of Q4_K shards only K*N/2 codes
+ Q4_K's two-level scales as stored (kernels/matmul/frag/kquant.py: 2 bytes per 32, 4 per 256: 4.625 bits a weight); other
INT4 types (Q4_0, Q4_1, Q4_K beside them) K*N/2 codes + a scale and an offset per 32; a layer of Q6_K shards only
its 6-bit codes in the W4A16 fragment layout + fp16 d * sc per 16 (kernels/matmul/frag/q6k.py: 7 bits; its planes,
6.5625 bits, stay where the fragment kernels do not run: the CPU, bf16 models); a layer of Q5_K
shards only its 5-bit codes in the fragment layout + fp16 (s, o) per 32 (kernels/matmul/frag/q5k.py: 6 bits; its planes
with Q4_K's two-level scales, 5.625 bits, where the fragment kernels do not run); Q8_0 / Q5_0 K*N int8 +
a scale per 32; Q5_1 (and Q5_K merged with another type) + an offset; Q6_K merged a scale per 16; scales and
offsets in the model dtype. A merged layer (qkv, gate_up) whose shards take different paths is one W8 layer at the
finest group (an INT4 shard widened to int8), except Q4_K / Q5_K beside Q6_K (Q4_K_M / Q5_K_M's qkv): each shard
in its own layout (quant/layers/parts.py). Embeddings and norms are dequantized to
the model dtype. (The CPU path keeps Q4_K / Q5_K / Q6_K's fp32 scales: exact, and more bytes than counted; so does
a bf16 model on CUDA, Gemma's: its scales stay fp32 rather than narrow to bf16.)"""
import re
from collections import Counter

from gguf import GGMLQuantizationType as T

from quant_serve.kernels.matmul.frag.q5k import frag5_bytes
from quant_serve.kernels.matmul.frag.q6k import frag6_bytes
from quant_serve.kernels.matmul.frag.kquant import kquant_bytes
from quant_serve.quant.formats.gguf.types import group_size_of, path_of

_OFFSETS = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_1, T.Q5_K)       # loaded with a float offset per group
# kept in the file's own codes; Q5_K and Q6_K as a CUDA fp16 model holds them (the W4A16 fragment layout: fp16
# (s, o) per 32, 6 bits; fp16 d * sc per 16, 7 bits)
_NATIVE = {T.Q4_K: kquant_bytes, T.Q5_K: frag5_bytes, T.Q6_K: frag6_bytes}
_MERGED = re.compile(r"^(blk\.\d+\.)(attn_q|attn_k|attn_v|ffn_gate|ffn_up)\.weight$")


def _layer_bytes(shards: list[tuple[T, int, int]], float_b: int) -> int:
    """One linear layer made of shards (type, K, N) -> bytes as loaded (make_linear's path choice)."""
    paths = {path_of(t) for t, _, _ in shards}
    if "dense" in paths:
        return sum(k * n * float_b for _, k, n in shards)
    if all(t in _NATIVE for t, _, _ in shards):             # native layouts, a mixed layer in parts
        return sum(_NATIVE[t](k, n) for t, k, n in shards)
    if paths == {"int4"}:
        return sum(k * n // 2 + k // 32 * n * float_b * 2 for _, k, n in shards)       # Q4_0: o = -8 d
    group = min(group_size_of(t) for t, _, _ in shards)
    offsets = any(t in _OFFSETS for t, _, _ in shards)
    return sum(k * n + k // group * n * float_b * (2 if offsets else 1) for _, k, n in shards)


def file_weight_bytes(tensors: dict, float_b: int) -> tuple[int, Counter]:
    """GGUF tensor table (name -> ReaderTensor) -> (bytes as loaded, type name -> number of matrices)."""
    layers: dict[str, list] = {}
    total, mix = 0, Counter()
    for name, t in tensors.items():
        shape = [int(x) for x in t.shape]
        if len(shape) != 2 or name == "token_embd.weight":
            n = 1
            for x in shape:
                n *= x
            total += n * float_b                                          # norms, biases, the embedding table
            if len(shape) == 2:
                mix[t.tensor_type.name] += 1
            continue
        mix[t.tensor_type.name] += 1
        m = _MERGED.match(name)
        key = (m[1] + ("qkv" if m[2].startswith("attn") else "gate_up")) if m else name
        layers.setdefault(key, []).append((t.tensor_type, shape[0], shape[1]))
    return total + sum(_layer_bytes(s, float_b) for s in layers.values()), mix


def mix_weight_bytes(cfg: dict, mix: str, float_b: int) -> tuple[int, Counter]:
    """A transformers config dict and a type mix (gguf_config.DUMMY_MIXES) -> (bytes as loaded, types)."""
    from quant_serve.quant.formats.gguf.config import dummy_gguf_config
    layers = cfg["num_hidden_layers"]
    type_of = dummy_gguf_config(mix, layers).type_of
    h, i, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or h // heads
    bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias"))
    total, types = 0, Counter()
    for layer in range(layers):
        p = f"model.layers.{layer}."
        groups = [[("self_attn.q_proj", h, heads * d), ("self_attn.k_proj", h, kv_heads * d),
                   ("self_attn.v_proj", h, kv_heads * d)], [("self_attn.o_proj", heads * d, h)],
                  [("mlp.gate_proj", h, i), ("mlp.up_proj", h, i)], [("mlp.down_proj", i, h)]]
        for group in groups:
            shards = [(type_of(p + name), k, n) for name, k, n in group]
            types.update(t.name for t, _, _ in shards)
            total += _layer_bytes(shards, float_b)
        total += (2 * h + (2 * kv_heads * d + heads * d if bias else 0)) * float_b
    total += (vocab * h + h) * float_b                                      # embedding table, final norm
    if not cfg.get("tie_word_embeddings"):
        total += _layer_bytes([(type_of("lm_head"), h, vocab)], float_b)
        types[type_of("lm_head").name] += 1
    return total, types


def describe_mix(mix: Counter) -> str:
    return ", ".join(f"{name} x {count}" for name, count in mix.most_common())
