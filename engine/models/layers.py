"""The decoder's small pieces: the two RMSNorm styles, the RoPE tables (default / linear / llama3 / longrope,
partial rotary) and the gated activations. Which one a model gets is data in ModelConfig."""
import math

import torch
from torch import nn

from quant_serve.engine.config import ModelConfig
from quant_serve.kernels.norm_act import rms_norm


class RMSNorm(nn.Module):
    """Llama / Qwen / Phi: normalize in fp32, round to the model dtype, multiply by the weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, H] -> normed; with residual: (normed(x + residual), x + residual) in one kernel on CUDA."""
        return rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma 2/3: the checkpoint stores w and the norm scales by (1 + w), everything in fp32, one rounding at the
    end (as transformers' Gemma2RMSNorm). Plain torch: no fused kernel has this rounding."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float()))
        normed = normed.to(x.dtype)
        return normed if residual is None else (normed, x)

    def init_dummy(self, gen: torch.Generator) -> None:
        self.weight.data.zero_()             # the identity scale of this style (--load-format dummy)


def make_norm(cfg: ModelConfig, dim: int, dtype, device) -> nn.Module:
    return (GemmaRMSNorm if cfg.gemma_norm else RMSNorm)(dim, cfg.rms_norm_eps, dtype, device)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies (head_dim here is the rotary width). long: longrope's long factors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "freq_factors":         # a GGUF's rope_freqs tensor (llama.cpp's form of llama 3's scaling)
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    if rope_type in ("longrope", "su"):
        # transformers' float32 arithmetic, so that the table matches it bit for bit
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (factors * theta ** shape)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3, longrope, "
                     "freq_factors)")


def longrope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin scale: the config's attention_factor, else sqrt(1 + ln(f) / ln(original)) with f the
    context extension (transformers' _compute_longrope_parameters)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """The cos/sin table of neox-style RoPE (rotate_half, as in the HF Llama/Qwen2 code), computed in fp32 like HF:
    cos_sin_cache[pos] = cat(cos, sin) [rotary_dim]. The rotation itself runs in kernels.paged_attention.rope_store_kv
    (or the decode kernel). LongRoPE (Phi-3): positions below original_max_position_embeddings take the short
    factors, the rest the long ones, a fixed table per position as vLLM builds it (transformers switches the whole
    sequence at once when it grows past the original length); both scaled by the attention factor."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None, device):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type in ("longrope", "su"):
            original = scaling["original_max_position_embeddings"]
            inv = torch.where((t < original)[:, None], rope_inv_freq(rotary_dim, theta, scaling)[None, :],
                              rope_inv_freq(rotary_dim, theta, scaling, long=True)[None, :])
            freqs = t[:, None] * inv
            mscale = longrope_attention_factor(scaling, max_positions)
        else:
            freqs = torch.outer(t, rope_inv_freq(rotary_dim, theta, scaling))        # [max_pos, rot/2]
            mscale = 1.0
        cache = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)       # [max_pos, rot]
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU, gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.gelu(gate, approximate="tanh") * up


SILU_ACTS = ("silu", "swish")
GELU_ACTS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")        # the tanh approximation, by its names
