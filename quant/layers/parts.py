"""A merged layer (qkv, gate_up) whose source modules load into different linear implementations: GGUF Q4_K_M
gives attn_q / attn_k Q4_K and attn_v Q6_K in some layers (Q5_K_M: Q5_K and Q6_K). Each run of consecutive shards
of one kind is its own linear (QuantLinear with Q4_K's two-level scales, W8Linear with Q5_K's or Q6_K's planes)
and the outputs are concatenated,
so every shard keeps its file's bits instead of the whole layer widening to int8 codes with a scale and an offset
per 16 (10 bits a weight)."""
import torch
from torch import nn

from quant_serve.kernels.norm_act import silu_and_mul


class PartsLinear(nn.Module):
    """y = cat([part(x) for part in parts], -1); N = sum(output_sizes). parts: (linear, shard ids of this layer it
    holds, in order); shard i of the layer is shard `local` of its part. Parts are loaded through this layer only
    (`routed_by_parent`: the loaders skip them)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, parts: list[tuple[nn.Module, list[int]]],
                 source_prefixes: list[str]):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.has_bias = bias
        self.source_prefixes = list(source_prefixes)
        self.parts = nn.ModuleList(linear for linear, _ in parts)
        self.route: dict[int, tuple[int, int]] = {}
        covered = []
        for p, (linear, shards) in enumerate(parts):
            linear.routed_by_parent = True
            for local, shard in enumerate(shards):
                self.route[shard] = (p, local)
            covered += shards
        if covered != list(range(len(output_sizes))):
            raise ValueError(f"{', '.join(source_prefixes)}: parts must hold the shards in order, got {covered}")
        self.device = parts[0][0].device

    def load_shard(self, shard_id: int, tensors: dict, prefix: str) -> None:
        if shard_id not in self.route:
            raise ValueError(f"{prefix}: shard {shard_id} out of range for output_sizes {self.output_sizes}")
        p, local = self.route[shard_id]
        self.parts[p].load_shard(local, tensors, prefix)

    def finalize(self) -> None:
        for part in self.parts:
            part.finalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)                     # [..., N]

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self(x))

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 W [N, K]."""
        return torch.cat([part.dequantized_weight() for part in self.parts], dim=0)
