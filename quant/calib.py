"""Calibration text and a plain-torch decoder forward (no paging) for the quantizers.

The forward mirrors engine/models/decoder.py (Llama / Qwen2 / Mistral: RMSNorm, neox RoPE, causal GQA attention,
SwiGLU) on HF-named weight dicts, split into the stages the quantizers need to observe:
    a = attn_input(x)          input of q/k/v
    o = attn_core(a)           input of o_proj
    h, m = mlp_input(x, o)     residual and input of gate/up
    d = mlp_act(m)             input of down
    y = block_output(h, d)
quant must not import engine, so the caller (server/cli_quantize.py) fills ModelSpec from the engine's config.
"""
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"


# ---- calibration text --------------------------------------------------------------------------------------

def read_calib_file(path: str | Path) -> list[str]:
    """Documents from a file: JSONL with a "text" field, or plain text split on `<|endoftext|>` (when present)
    or on blank lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    raw = path.read_text(encoding="utf-8", errors="replace")
    first = raw.lstrip()[:1]
    if path.suffix == ".jsonl" or first == "{":
        docs = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e}); use JSONL with a \"text\" field") from e
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n}: JSONL calibration rows need a \"text\" string field")
            docs.append(row["text"])
    else:
        parts = raw.split(EOT) if EOT in raw else raw.split("\n\n")
        docs = [p.strip("\n") for p in parts]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"calibration file {path} holds no text")
    return docs


def calib_tokens(docs: list[str], encode: Callable[[str], list[int]], num_samples: int, seq_len: int,
                 separator: list[int] = (), seed: int = 0) -> torch.Tensor:
    """Documents -> [S, L] int64: shuffled (fixed seed), joined by `separator` token ids, cut into S windows of L
    tokens (AutoAWQ style). S = num_samples, or fewer when the text is short (at least one full window)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    need = num_samples * seq_len
    for i in order:
        ids.extend(encode(docs[i]))
        ids.extend(separator)
        if len(ids) >= need:
            break
    n = min(num_samples, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"calibration text has only {len(ids)} tokens, fewer than one window of {seq_len}; "
                         "pass more text or a smaller --calib-seq-len")
    return torch.tensor(ids[:n * seq_len], dtype=torch.int64).view(n, seq_len)


# ---- the plain forward -------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    inv_freq: torch.Tensor                # [head_dim / 2] fp32, rope scaling already applied
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rope_tables(spec: ModelSpec, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> cos, sin [L, D/2] for positions 0..L-1."""
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), spec.inv_freq.float().cpu())
    return freqs.cos().to(device), freqs.sin().to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def linear(w: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] (neox halves) rotated by cos/sin [L, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attn_input(w: dict, x: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return rms_norm(x, w["input_layernorm.weight"], spec.rms_norm_eps)


def attn_core(w: dict, a: torch.Tensor, spec: ModelSpec, rope) -> torch.Tensor:
    """a [B, L, H] -> causal attention output before o_proj [B, L, Hq*D]."""
    b, seq, _ = a.shape
    d = spec.head_dim
    q = linear(w, "self_attn.q_proj", a).view(b, seq, spec.num_heads, d).transpose(1, 2)
    k = linear(w, "self_attn.k_proj", a).view(b, seq, spec.num_kv_heads, d).transpose(1, 2)
    v = linear(w, "self_attn.v_proj", a).view(b, seq, spec.num_kv_heads, d).transpose(1, 2)
    cos, sin = rope[0][:seq], rope[1][:seq]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    rep = spec.num_heads // spec.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # [B, Hq, L, D]
    return out.transpose(1, 2).reshape(b, seq, spec.q_size)


def mlp_input(w: dict, x: torch.Tensor, o: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (h = x + o_proj(o), post-attention norm of h)."""
    h = x + linear(w, "self_attn.o_proj", o)
    return h, rms_norm(h, w["post_attention_layernorm.weight"], spec.rms_norm_eps)


def mlp_act(w: dict, m: torch.Tensor) -> torch.Tensor:
    return F.silu(linear(w, "mlp.gate_proj", m)) * linear(w, "mlp.up_proj", m)


def block_output(w: dict, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return h + linear(w, "mlp.down_proj", d)


def attn_module(w: dict, a: torch.Tensor, spec: ModelSpec, rope) -> torch.Tensor:
    """The self-attention module's output (o_proj applied), as AWQ inspects it for the q/k/v scales."""
    return linear(w, "self_attn.o_proj", attn_core(w, a, spec, rope))


def mlp_module(w: dict, m: torch.Tensor) -> torch.Tensor:
    return linear(w, "mlp.down_proj", mlp_act(w, m))


def block_forward(w: dict, x: torch.Tensor, spec: ModelSpec, rope) -> torch.Tensor:
    o = attn_core(w, attn_input(w, x, spec), spec, rope)
    h, m = mlp_input(w, x, o, spec)
    return block_output(w, h, mlp_act(w, m))


def chunked(fn: Callable, *tensors: torch.Tensor, chunk: int) -> torch.Tensor:
    """fn over slices of dim 0 (calibration sequences), concatenated: bounds the transient activations."""
    outs = [fn(*(t[i:i + chunk] for t in tensors)) for i in range(0, tensors[0].shape[0], chunk)]
    return torch.cat(outs)


@torch.no_grad()
def model_logits(spec: ModelSpec, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Full model on HF-named fp32 weights: ids [B, L] -> logits [B, L, vocab] fp32."""
    device = weights["model.embed_tokens.weight"].device
    rope = rope_tables(spec, ids.shape[1], device)
    x = weights["model.embed_tokens.weight"][ids.to(device)]
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        block = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        x = block_forward(block, x, spec, rope)
    x = rms_norm(x, weights["model.norm.weight"], spec.rms_norm_eps)
    head = weights["model.embed_tokens.weight"] if spec.tie_word_embeddings else weights["lm_head.weight"]
    return F.linear(x, head)


def gram(x: torch.Tensor, chunk_tokens: int = 8192) -> torch.Tensor:
    """x [..., K] -> X^T X [K, K] fp32 summed over every token, accumulated in chunks."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, flat.shape[0], chunk_tokens):
        part = flat[i:i + chunk_tokens].float()
        out.addmm_(part.t(), part)
    return out
