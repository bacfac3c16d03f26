"""Configuration passed down from the CLI. Plain dataclasses; no environment variables."""
import logging
from dataclasses import dataclass, field

import torch

from quant_serve.kernels.gpu import KernelOptions

BLOCK_SIZE = 16


@dataclass
class ModelConfig:
    """What the decoder needs, read from a Hugging Face config (Llama, Qwen2, Mistral)."""
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # llama3 / linear / dynamic parameters, None for default rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool               # q/k/v biases (Qwen2: True)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype = torch.float16   # the checkpoint's dtype
    quantization_config: dict | None = None
    sliding_window: int | None = None      # we attend over the full context, so max_model_len is capped at this


@dataclass
class CacheConfig:
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int | None = None      # exact block count (tests); None = from kv_cache_memory_gb or the plan
    kv_cache_dtype: str = "auto"           # auto | fp16 | bf16 | fp8 | fp8_e4m3 | fp8_e5m2
    gpu_memory_utilization: float = 0.90
    gpu_memory_gb: float | None = None      # plan for a card of this size (emulate a 24 GB card); None = the real one
    kv_cache_memory_gb: float | None = None  # explicit KV pool size; None = planned on CUDA, 1 GiB on the CPU path
    enable_prefix_caching: bool = True
    kv_scale_source: str = "auto"          # fp8 K/V scales: auto | checkpoint | file | first-prompt | unit
    cpu_kv_gb: float = 0                   # CPU tier (host memory) for swapped and evicted KV blocks; 0 = none
    num_cpu_blocks: int | None = None      # exact CPU tier block count (tests); None = from cpu_kv_gb


# Token budget per step, as vLLM sets it on cards under 70 GiB: a server keeps steps short for inter-token latency,
# offline work (generate, bench offline, eval) takes longer steps, which amortize each step's weight reads over more
# prompt tokens (fewer mixed steps, fewer INT4 dequantize passes).
SERVE_BATCHED_TOKENS = 2048
OFFLINE_BATCHED_TOKENS = 8192


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = SERVE_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


HEAD_GROUP_SIZE = 128                     # inputs per scale of the --quantize-lm-head copy


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"                    # auto | float16 | bfloat16 | float32
    device: str = "auto"                   # auto | cuda | cpu
    load_format: str = "auto"              # auto | safetensors | dummy
    quantization: str | None = None        # override auto-detection
    quantize_lm_head: bool = False         # an INT4 copy of the head at load (round-to-nearest, HEAD_GROUP_SIZE)
    revision: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = True          # schedule and launch a step before the previous one's tokens are back
    max_model_len: int | None = None       # None = from the model config
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelOptions = field(default_factory=KernelOptions)   # kernel switches and the GPU profile


def resolve_max_model_len(model: ModelConfig, wanted: int | None) -> int:
    """The engine's context limit: the one asked for, within the model's positions and sliding window."""
    limit = model.max_position_embeddings
    if model.sliding_window and model.sliding_window < limit:
        logging.getLogger("quant_serve").info("capping max_model_len at the sliding window of %d tokens",
                                              model.sliding_window)
        limit = model.sliding_window
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit} tokens "
                         "(max_position_embeddings or sliding window)")
    return wanted
