"""Batched LoRA (Punica / S-LoRA style): each token row carries an adapter slot, rows with different adapters and
none (-1) run in one step. shrink: h = x @ A[slot]^T, expand: y[:, cols] += h @ B[slot]^T. reference.py holds the
torch twins, triton_kernels.py the kernels; `lora_shrink` / `lora_expand` pick one by device."""
from quant_serve.kernels.lora.dispatch import lora_expand, lora_shrink

__all__ = ["lora_expand", "lora_shrink"]
