"""Finding a model, checking a checkpoint, its config, and building the decoder from its weights (GGUF in load/gguf/)."""
