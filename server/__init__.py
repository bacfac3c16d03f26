"""OpenAI-compatible server and the quant-serve CLI."""
