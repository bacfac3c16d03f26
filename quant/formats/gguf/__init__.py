"""GGUF tensor types as quant-serve's internal layouts, a GGUF model's per-layer decisions, a K-quant quantizer."""
