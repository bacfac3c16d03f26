"""Checkpoint formats, the internal INT4 layout's producers, QuantLinear and the quantizers. Imports kernels."""
