"""One decoder for Llama, Qwen2 and Mistral."""
