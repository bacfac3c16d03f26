"""Model, loader, KV blocks, scheduler, runner, sampler, detokenizer, LLMEngine. Imports quant, kernels."""
