"""8-bit weight-only linear (kernels/w8a16): the layers of GGUF files whose type has no INT4 form (Q8_0, Q5_0,
Q5_1, Q5_K, Q6_K), loaded without re-quantizing (a layer of Q5_K or Q6_K shards in its 5- / 6-bit planes).
Beside quant/layers/linear.py's QuantLinear; the same shard protocol."""
from dataclasses import dataclass

import torch
from torch import nn

from quant_serve.kernels.norm_act import silu_and_mul
from quant_serve.kernels.matmul.dispatch import w4a16_matmul
from quant_serve.kernels.matmul.frag.layout import ZP_Q5, FragWeights
from quant_serve.kernels.matmul.frag.q5k import frag5_dequantize_ref
from quant_serve.kernels.matmul.frag.q6k import frag6_dequantize_ref
from quant_serve.kernels.matmul.frag.kquant import kquant_scales_offsets
from quant_serve.kernels.matmul.reference_int8_codes import w8_act_group_size, w8a8_matmul_ref
from quant_serve.kernels.matmul.dispatch import prepare_q5k, prepare_q6k, w8a16_matmul
from quant_serve.kernels.matmul.planes.q5k import Q5_GROUP, Q5KWeights, concat_q5k, pack_q5k, q5k_codes, q5k_dequantize
from quant_serve.kernels.matmul.planes.q6k import (Q6_GROUP, Q6KWeights, concat_q6k, pack_q6k, q6k_codes, q6k_dequantize,
                                           q6k_scales)
from quant_serve.kernels.matmul.reference_planes import dequantize_w8
from quant_serve.quant.layers.linear import gguf_kernel_scale_dtype, scale_dtype


@dataclass
class W8Weights:
    """One source module in the W8 layout (kernels/matmul/reference_planes.py)."""
    qweight: torch.Tensor | None          # int8 [K, N]
    scales: torch.Tensor | None           # [G, N]
    offsets: torch.Tensor | None          # [G, N] or None (= 0)
    bias: torch.Tensor | None = None      # [N]
    q6k: Q6KWeights | None = None         # GGUF Q6_K at 6 bits (kernels/matmul/planes/q6k.py) instead of the three above
    q5k: Q5KWeights | None = None         # GGUF Q5_K at 5 bits (kernels/matmul/planes/q5k.py) instead of the three above


class W8Linear(nn.Module):
    """y = x @ W (+ bias), W[k, n] = q[k, n] * s[g, n] + o[g, n]; N = sum(output_sizes), shards concatenated along
    N at finalize. quant_config.convert_w8 turns one source module's tensors into W8Weights.
    q6k_planes (a layer of GGUF Q6_K shards only, set by GGUFConfig): the layer holds Q6_K's 6-bit planes instead
    (qweight: uint8 planes [3K/4, N], scales: int8 sub-scales [K/16, N], superscales: fp16 d [K/256, N]; 6.5625
    bits a weight), converted by quant_config.convert_q6k. q5k_planes (a layer of GGUF Q5_K shards only): Q5_K's
    5-bit planes (qweight: uint8 [5K/8, N], scales: int16 sub-codes sc | m << 8 [K/32, N], superscales: int32
    d | dmin [K/256, N]; 5.625 bits a weight), converted by quant_config.convert_q5k. On CUDA with fp16
    activations a Q6_K layer is then held in the W4A16 fragment layout instead (frag6: qweight the low-nibble
    words, scales fp16 d * sc [K/16, N], superscales the high-bit words; kernels/matmul/frag/q6k.py, 7 bits a weight)
    and runs the tensor-core kernels; a Q5_K layer likewise (frag5: qweight the low-nibble words, scales the int32
    fp16 (s, o) pairs [K/32, N], superscales the high-bit words; kernels/matmul/frag/q5k.py, 6 bits a weight)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str, quant_config, group_size: int, source_prefixes: list[str] = ()):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.group_size = group_size
        self.has_bias = bias
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant_config = quant_config
        self.source_prefixes = list(source_prefixes) or [f"shard {i}" for i in range(len(output_sizes))]
        self._shards: list[W8Weights | None] | None = [None] * len(output_sizes)
        self.dummy_offsets = False            # init_dummy: per-group offsets too (a GGUF Q5_K / INT4 shard's)
        self.q6k_planes = False
        self.q5k_planes = False
        self.frag: FragWeights | None = None
        self.act_scale: str | None = None     # None: activations in the model dtype; "token" / "group": int8 (W8A8)
        for name in ("qweight", "scales", "offsets", "superscales", "bias"):
            self.register_buffer(name, None)

    def load_shard(self, shard_id: int, tensors: dict, prefix: str) -> None:
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{prefix}: shard {shard_id} out of range for output_sizes {self.output_sizes}")
        if self._shards[shard_id] is not None:
            raise ValueError(f"{prefix}: shard {shard_id} loaded twice")
        n, k = self.output_sizes[shard_id], self.in_features
        if self.q6k_planes or self.q5k_planes:
            convert = self.quant_config.convert_q6k if self.q6k_planes else self.quant_config.convert_q5k
            w = convert(tensors, prefix, k, n)
            if (w.bias is not None) != self.has_bias:
                raise ValueError(f"{prefix}.bias {'present' if w.bias is not None else 'missing'}, but the config "
                                 f"says this layer has {'a' if self.has_bias else 'no'} bias")
            w.q6k = None if w.q6k is None else w.q6k.to(self.device)
            w.q5k = None if w.q5k is None else w.q5k.to(self.device)
            w.bias = None if w.bias is None else w.bias.to(self.device, self.dtype)
            self._shards[shard_id] = w
            return
        w = self.quant_config.convert_w8(tensors, prefix, k, n, self.group_size)
        g = -(-k // self.group_size)
        if tuple(w.qweight.shape) != (k, n) or tuple(w.scales.shape) != (g, n):
            raise ValueError(f"{prefix}: W8 codes {tuple(w.qweight.shape)} and scales {tuple(w.scales.shape)}, "
                             f"expected {(k, n)} and {(g, n)}")
        if (w.bias is not None) != self.has_bias:
            raise ValueError(f"{prefix}.bias {'present' if w.bias is not None else 'missing'}, but the config says "
                             f"this layer has {'a' if self.has_bias else 'no'} bias")
        sdtype = self._param_dtype(w.scales.dtype)
        w.qweight = w.qweight.to(self.device, torch.int8).contiguous()
        w.scales = w.scales.to(self.device, sdtype).contiguous()
        w.offsets = None if w.offsets is None else w.offsets.to(self.device, sdtype).contiguous()
        w.bias = None if w.bias is None else w.bias.to(self.device, self.dtype)
        self._shards[shard_id] = w

    def finalize(self) -> None:
        if self._shards is None:
            return
        missing = [p for p, s in zip(self.source_prefixes, self._shards) if s is None]
        if missing:
            raise ValueError(f"8-bit layer never received tensors for {', '.join(missing)}")
        shards = self._shards
        if self.q6k_planes or self.q5k_planes:
            if self.q6k_planes:
                self._set_q6k(concat_q6k([s.q6k for s in shards]))
            else:
                self._set_q5k(concat_q5k([s.q5k for s in shards]))
            self.bias = torch.cat([s.bias for s in shards]) if self.has_bias else None
            self._shards = None
            return
        dtypes = {s.scales.dtype for s in shards}
        sdtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.qweight = torch.cat([s.qweight for s in shards], dim=1)                        # [K, N]
        self.scales = torch.cat([s.scales.to(sdtype) for s in shards], dim=1)              # [G, N]
        self.offsets = None if all(s.offsets is None for s in shards) else torch.cat(
            [torch.zeros_like(s.scales, dtype=sdtype) if s.offsets is None else s.offsets.to(sdtype)
             for s in shards], dim=1)                                                      # [G, N]
        self.bias = torch.cat([s.bias for s in shards]) if self.has_bias else None
        self._shards = None

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random 6-bit codes and fp32 scales (weights about N(0, 0.02)), as a loaded Q6_K layer holds them (and
        fp32 offsets where dummy_offsets; Q6_K / Q5_K planes with their two-level scales), for --load-format
        dummy."""
        k, n = self.in_features, self.out_features
        g = -(-k // self.group_size)
        codes = torch.randint(-32, 32, (k, n), generator=gen, dtype=torch.int8, device=gen.device)
        self._shards = None
        self.bias = torch.zeros(n, dtype=self.dtype, device=self.device) if self.has_bias else None
        if self.q6k_planes:             # sc = 40, d = 0.02 / 18.5 / 40: the scale below as Q6_K's two levels
            d = torch.full((-(-k // 256), n), 0.02 / 18.5 / 40, dtype=torch.float16, device=self.device)
            sub = torch.full((k // Q6_GROUP, n), 40, dtype=torch.int8, device=self.device)
            self._set_q6k(pack_q6k(codes.to(self.device), sub, d))
            return
        if self.q5k_planes:             # q = (codes + 32) / 2, s = d * sc = 2 x the scale below, o = -16 s
            sub = torch.full((k // Q5_GROUP, n), 40 | (40 << 8), dtype=torch.int16, device=self.device)
            d = torch.tensor([0.04 / 18.5 / 40, 16 * 0.04 / 18.5 / 40], dtype=torch.float16)
            bits = d.view(torch.int16).to(torch.int32) & 0xFFFF
            dd = torch.full((-(-k // 256), n), int(bits[0] | (bits[1] << 16)), dtype=torch.int32, device=self.device)
            self._set_q5k(pack_q5k(((codes.to(torch.int16) + 32) >> 1).to(self.device), sub, dd))
            return
        self.qweight = codes.to(self.device)
        self.scales = torch.full((g, n), 0.02 / 18.5, dtype=self._param_dtype(torch.float32), device=self.device)
        self.offsets = torch.zeros_like(self.scales) if self.dummy_offsets else None
        self._shards = None
        self.bias = torch.zeros(n, dtype=self.dtype, device=self.device) if self.has_bias else None

    def _set_q6k(self, w: Q6KWeights) -> None:
        w = prepare_q6k(w, self.dtype)
        if isinstance(w, FragWeights):
            self.frag = w
            self.qweight, self.scales, self.superscales, self.offsets = w.words, w.scales, w.hi, None
            return
        self.qweight, self.scales, self.superscales, self.offsets = w.planes, w.sub_scales, w.d, None

    def _set_q5k(self, w: Q5KWeights) -> None:
        w = prepare_q5k(w, self.dtype)
        if isinstance(w, FragWeights):
            self.frag = w
            self.qweight, self.scales, self.superscales, self.offsets = w.words, w.scales, w.hi, None
            return
        self.qweight, self.scales, self.superscales, self.offsets = w.planes, w.sub_codes, w.superscales, None

    def _native(self) -> "Q6KWeights | Q5KWeights":
        cls = Q5KWeights if self.q5k_planes else Q6KWeights
        return cls(self.qweight, self.scales, self.superscales)

    def _param_dtype(self, checkpoint: torch.dtype) -> torch.dtype:
        """Scales and offsets: exact on the CPU path (fp32 for Q5_K / Q6_K's products of two scales); on CUDA fp16
        on an fp16 model (Q6_K: 9 bits a weight instead of 10, its products rounded), never bf16."""
        if self.device.type == "cuda":
            return gguf_kernel_scale_dtype(checkpoint, self.dtype)
        return scale_dtype(checkpoint, self.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 W [N, K] (what nn.Linear would hold)."""
        if self.frag is not None:
            ref = frag5_dequantize_ref if self.frag.zp_mode == ZP_Q5 else frag6_dequantize_ref
            return ref(self.frag).float().t()
        if self.superscales is not None:
            return (q5k_dequantize(self._native()) if self.q5k_planes else q6k_dequantize(self._native())).t()
        return dequantize_w8(self.qweight, self.scales, self.offsets, self.group_size).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_scale is not None:
            return self._forward_int8(x)
        if self.frag is not None:
            return w4a16_matmul(x, self.frag, bias=self.bias)
        if self.superscales is not None:
            return w8a16_matmul(x, self._native(), None, None, Q5_GROUP if self.q5k_planes else Q6_GROUP, self.bias)
        return w8a16_matmul(x, self.qweight, self.scales, self.offsets, self.group_size, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self(x))

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        """The W8A8 twin over the layer's integer codes (Q5_K / Q6_K planes unpacked each call)."""
        if self.frag is not None:
            raise ValueError("int8 activations: no twin over the W4A16 fragment layout (CUDA); use the CPU path")
        if self.superscales is None:
            codes, scales, offsets, group = self.qweight, self.scales, self.offsets, self.group_size
        elif self.q5k_planes:
            w = self._native()
            codes, group = q5k_codes(w), Q5_GROUP
            scales, offsets = kquant_scales_offsets(w.sub_codes, w.superscales)
        else:
            w = self._native()
            codes, scales, offsets, group = q6k_codes(w), q6k_scales(w), None, Q6_GROUP
        act_group = w8_act_group_size(self.act_scale, self.in_features, group)
        return w8a8_matmul_ref(x, codes, scales, offsets, group, act_group, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_sizes={self.output_sizes}, group_size={self.group_size}, "
                f"bias={self.has_bias}, offsets={self.offsets is not None}, q6k_planes={self.q6k_planes}, "
                f"q5k_planes={self.q5k_planes}, frag={self.frag is not None}")
