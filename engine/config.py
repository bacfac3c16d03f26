"""Configuration passed down from the CLI. Plain dataclasses; no environment variables."""
from dataclasses import dataclass, field

import torch

from quant_serve.kernels.gpu import KernelOptions

BLOCK_SIZE = 16


@dataclass
class ModelConfig:
    """What the decoder needs, read from a Hugging Face config (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3). The
    families differ only in these values; engine/models/decoder.py reads them."""
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
    layer_windows: tuple[int, ...] = ()    # per layer: its sliding window in tokens, 0 = global; () = all global
    qk_norm: bool = False                  # Qwen3, Gemma 3: RMSNorm of each q and k head before RoPE
    gemma_norm: bool = False               # Gemma: norms scale by (1 + weight), in fp32
    sandwich_norms: bool = False           # Gemma 2/3: norms after attention and around the MLP
    embed_scale: float | None = None       # Gemma: embeddings times sqrt(hidden_size) (in the model dtype)
    query_pre_attn_scalar: float | None = None   # Gemma: softmax scale is this ** -0.5, not head_dim ** -0.5
    attn_logit_softcap: float = 0.0        # Gemma 2: attention scores capped by a tanh (0: off)
    final_logit_softcap: float = 0.0       # Gemma 2: logits capped by a tanh (0: off)
    local_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' rope base (their own table)
    local_rope_scaling: dict | None = None
    rotary_dim: int | None = None          # partial rotary (Phi-4-mini): the first rotary_dim of head_dim; None = all
    fused_checkpoint: bool = False         # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def llama_block(self) -> bool:
        """The plain pre-norm SwiGLU block with Llama norms (what the folded-norm decode path implements)."""
        return not (self.qk_norm or self.gemma_norm or self.sandwich_norms or self.embed_scale
                    or self.hidden_act not in ("silu", "swish") or (self.rotary_dim or self.head_dim) != self.head_dim)


@dataclass
class CacheConfig:
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int | None = None      # exact block count (tests); None = from kv_cache_memory_gb or the plan
    kv_cache_dtype: str = "auto"           # auto | fp16 | bf16 | fp8 | fp8_e4m3 | fp8_e5m2 | int8 | int4
    # integer caches (kernels/attention/kv_int.py): head_dim elements per scale and a zero point beside it;
    # None = the measured defaults (INT_KV_DEFAULTS). Not CLI flags: bench/kv_quant_accuracy.py compares them.
    kv_group_size: int | None = None
    kv_zero_point: bool | None = None
    kv_rotate: bool | None = None          # K and V rotated by a Hadamard matrix over head_dim before the store
    # integer caches: each sequence's last N tokens also kept unquantized and read exact (kernels/attention/
    # kv_exact.py); None = the dtype's default (INT_KV_EXACT_TOKENS), 0 = off (CUDA graphs need 0 for now)
    kv_exact_tokens: int | None = None
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
    max_loras: int = 0                     # distinct LoRA adapters among the running sequences (0: no limit)


SPEC_METHODS = ("ngram", "draft_model")
# Speculation turns itself off above this many unfinished sequences: verifying k+1 tokens per sequence is nearly free
# only while a step is bound by reading the weights. `python bench/spec_decode.py verify-cost` (H100, Qwen2.5-7B AWQ,
# context 512, k = 4): a verification costs 1.11x a decode step at batch 1, 1.39x at batch 4, 1.85x at batch 16,
# where prompt lookup's break-even on the acceptance bench is 1.98x (copy) / 2.70x (free): 4 keeps the margin.
SPEC_DISABLE_BATCH_SIZE = 4


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config keys). num_speculative_tokens 0 = off."""
    method: str = "ngram"                  # ngram (prompt lookup) | draft_model
    num_speculative_tokens: int = 0        # k: tokens proposed per step and verified in one forward
    prompt_lookup_min: int = 2             # ngram: shortest suffix matched against prompt + output
    prompt_lookup_max: int = 4             # ngram: longest, tried first
    model: str | None = None               # draft_model: a model with the target's tokenizer
    disable_by_batch_size: int = SPEC_DISABLE_BATCH_SIZE   # off while more sequences than this are unfinished
    # per sequence: after this many verifications in a row accept nothing, skip proposing for 1, 2, 4, ... 32
    # steps (a verification that accepts nothing costs more than a decode step); 0 = never back off
    backoff_after: int = 2

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(SPEC_METHODS)}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and self.num_speculative_tokens and not self.model:
            raise ValueError("speculative method draft_model needs a draft model (--speculative-model)")
        if self.backoff_after < 0:
            raise ValueError(f"backoff_after must be >= 0, got {self.backoff_after}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


HEAD_GROUP_SIZE = 128                     # inputs per scale of the --quantize-lm-head copy


@dataclass
class LoRAConfig:
    """LoRA adapters served per request (vLLM's --enable-lora flags). Adapters live in max_loras device slots,
    zero-padded to max_lora_rank."""
    enable_lora: bool = False
    max_loras: int = 1                      # adapters on the device at once (one step may mix them all)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None       # adapters held in host memory, swapped into the slots (LRU); None: max_loras
    lora_modules: dict[str, str] = field(default_factory=dict)   # name -> adapter dir, loaded at start

    def __post_init__(self):
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        places = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if self.enable_lora and len(self.lora_modules) > places:
            raise ValueError(f"{len(self.lora_modules)} --lora-modules do not fit --max-cpu-loras {places} "
                             "(default: --max-loras)")


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # structured outputs: tokens a grammar forces in a row (the keys of a JSON schema) are appended without a forward
    # each, up to this many at a time (jump-forward); 0 samples every token
    structured_forced_tokens: int = 32
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def resolve_max_model_len(model: ModelConfig, wanted: int | None) -> int:
    """The engine's context limit: the one asked for, within the model's positions (sliding-window layers attend
    over their window, so a window does not limit the context)."""
    limit = model.max_position_embeddings
    if wanted is None:
        return limit
    if wanted > limit:
        raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit} tokens "
                         "(max_position_embeddings)")
    return wanted
