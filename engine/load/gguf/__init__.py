"""GGUF checkpoints: the reader, hub repositories of many quantizations, hyper-parameters, weight bytes by type."""
