"""The device side of a step: the model runner, CUDA graphs, warm-up and start-up, the KV pool and its CPU-tier swaps,
KV scales."""
