"""Which weight formats may take int8 activations by default (--activation-dtype auto): the accuracy half of the
choice, one table that the CPU resolution (quant/activations.py) and the GPU plan read. The GPU plan adds the speed
half (int8 only where its W4A8 kernel is faster); the CPU path has no speed to win and follows the table alone.

The gate (issue #53): against the W4A16 path of the same weights, at most +GATE_PPL_PCT % perplexity and
GATE_KLD KL divergence, measured by bench/act_int8_accuracy.py (bench/results/act-int8-accuracy-tiny-qwen2.json).
"""
from collections.abc import Iterable

GATE_PPL_PCT = 0.2
GATE_KLD = 0.003

# weight format -> the activation scale granularities ("token", "group") whose int8 path met the gate on every
# model measured in that format. Formats: a checkpoint's method (awq, gptq, compressed-tensors), "rtn" (the
# --quantize-lm-head copy), or "gguf:TYPE" per tensor type (a merged layer of several types needs all of them).
# A format not listed keeps fp16 activations under auto.
INT8_ACTIVATIONS_FREE: dict[str, tuple[str, ...]] = {}


def int8_is_free(formats: Iterable[str], act_scale: str) -> bool:
    """Whether a layer of these weight formats met the accuracy gate with int8 activations at act_scale."""
    formats = list(formats)
    return bool(formats) and all(act_scale in INT8_ACTIVATIONS_FREE.get(f, ()) for f in formats)
