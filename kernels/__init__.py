"""Triton kernels and their plain-torch twins. Imports torch and triton only.

The version attribute matters: transformers probes an importable top-level `kernels` module (the Hugging Face
kernels hub package) and accepts it only for versions 0.16-0.17; ours must never look like that package.
"""
__version__ = "0.1.0+quant-serve"
