"""A LoRA wrapper around any linear layer of the model (DenseLinear, QuantLinear, W8Linear, GGUF's): the base runs
as it is and each row adds its adapter's delta, y += scale * (x @ A^T) @ B^T, so adapters apply to every weight
format alike. A merged layer (qkv, gate_up) takes the adapters of its parts: one A stack with each part's rank-R
block side by side, one B stack with the parts' outputs one after another: one shrink and one expand a layer.

Adapters sit in --max-loras slots of stacked tensors on the model's device (zero-padded to --max-lora-rank, the
scaling folded into B). Which slot each row of a step uses is the runner's LoRABatch, shared by every wrapper of a
model (set before each forward); with no adapter in a step the wrapper costs one attribute read.
"""
from dataclasses import dataclass

import torch
from torch import nn

from quant_serve.kernels.lora import lora_expand, lora_shrink
from quant_serve.kernels.norm_act import silu_and_mul


@dataclass
class LoRABatch:
    """The step's adapter slot per token row: [T] int32 on the model's device, -1 for the base; None when no row of
    the step has an adapter (the wrappers run the base alone)."""
    slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, batch: LoRABatch, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.output_sizes = list(base.output_sizes)
        self.out_features = sum(self.output_sizes)
        self.max_rank = max_rank
        self.batch = batch
        parts = len(self.output_sizes)
        # [S, parts * R, K]: part i's A in rows i*R:(i+1)*R
        self.register_buffer("lora_a", torch.zeros(max_loras, parts * max_rank, self.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        # [S, N, R]: part i's B in its output columns' rows, the scaling folded in
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype,
                                                   device=device), persistent=False)

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> None:
        """weights: per part (A [r, K], B [N_i, r], scale) or None where the adapter leaves the part alone;
        r <= max_rank (checked by the adapter loader, which names the tensor)."""
        self.clear_slot(slot)
        r_max, col = self.max_rank, 0
        for i, (pair, n) in enumerate(zip(weights, self.output_sizes)):
            if pair is not None:
                a, b, scale = pair
                r = a.shape[0]
                self.lora_a[slot, i * r_max:i * r_max + r] = a.to(self.lora_a)
                self.lora_b[slot, col:col + n, :r] = (b.float() * scale).to(self.lora_a)
            col += n

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                                   # [T, N]
        slots = self.batch.slots
        if slots is None:
            return y
        if x.dim() != 2 or x.shape[0] != slots.shape[0]:
            raise ValueError(f"LoRA layer got input of shape {tuple(x.shape)} for a step of {slots.shape[0]} "
                             "token rows: adapters apply to the flattened [T, K] paged path only")
        h = lora_shrink(x, self.lora_a, slots)                  # [splits, T, parts * R] fp32 partial sums
        return lora_expand(h, self.lora_b, slots, y, self.output_sizes)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A merged gate | up layer with its adapters, then SwiGLU: [T, K] -> [T, N/2]."""
        return silu_and_mul(self(x))

    def extra_repr(self) -> str:
        return f"slots={self.lora_a.shape[0]}, max_rank={self.max_rank}, output_sizes={self.output_sizes}"
