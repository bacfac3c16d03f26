"""LoRA adapters served per request on the (quantized) base: PEFT's on-disk format (adapter.py), the slots on the
device and the per-step batch (manager.py). The layer wrapper is quant/layers/lora.py, the kernels kernels/lora/."""
