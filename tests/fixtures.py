"""Fixture models the tests make themselves (conftest.py builds each once per session, under pytest's tmp dir):

- a small random-weight Qwen2 laid out like tiny-qwen2 (its tokenizer and chat template, tied head, q/k/v biases,
  2,048 positions, FP16 in sharded safetensors with an index), for tests that need "a model" and not a good one;
- INT4 checkpoints of it written by our own quantizer (AWQ gemm, GPTQ, compressed-tensors);
- the trained tiny model in FP16: the bundled demo model (tiny-qwen2 quantized by our AWQ) dequantized by our
  readers, for tests whose meaning rests on a model that writes sensible text.
"""
import json
import shutil
from pathlib import Path

import torch

from quant_serve.engine.load.demo import DEMO_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 8192                 # the demo tokenizer's vocabulary
RANDOM_QWEN2 = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                    rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2, pad_token_id=0)


def copy_tokenizer(path: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_MODEL_DIR / name, Path(path) / name)


def write_random_qwen2(path: Path, **overrides) -> Path:
    """A seeded random Qwen2 (RANDOM_QWEN2 with `overrides`) saved by transformers in FP16, in shards of at most
    1 MB (the embedding alone in the first), with the demo model's tokenizer. Weights N(0, 0.08) so that logits
    differ clearly from token to token; norms around 1."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(**(RANDOM_QWEN2 | overrides))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.08)
    model.to(torch.float16).save_pretrained(str(path), max_shard_size="1MB")
    copy_tokenizer(path)
    return Path(path)


def write_int4(src: Path, out: Path, fmt: str, sym: bool) -> Path:
    """src quantized by our RTN (g128) into `fmt` (awq, gptq, gptq_v2, compressed-tensors)."""
    from quant_serve.quant.quantize import QuantizeConfig, quantize_model
    from quant_serve.server.cli.quantize import load_source
    return quantize_model(load_source(src), None, QuantizeConfig(method="rtn", sym=sym, format=fmt), out,
                          show_progress=False)


def write_trained_fp16(out: Path) -> Path:
    """The demo model's INT4 weights dequantized by our readers, saved as an FP16 checkpoint (one file) with its
    tokenizer and chat template: tiny-qwen2's architecture and, up to the INT4 rounding, its weights."""
    from safetensors.torch import save_file

    from helpers import bench_script
    weights = bench_script("quant_quality").dense_weights(DEMO_MODEL_DIR)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.half().contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in DEMO_MODEL_DIR.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    return out
