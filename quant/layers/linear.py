"""Linear layers the model is built from. A merged layer (qkv, gate_up) is filled shard by shard from the
checkpoint's separate modules; `load_shard` receives one source module's raw tensors by their checkpoint names."""
import torch
from torch import nn

from quant_serve.kernels.norm_act import silu_and_mul
from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights, twin_args, w4a16_matmul
from quant_serve.kernels.matmul.frag.layout import FragWeights
from quant_serve.kernels.matmul.frag.kquant import (kquant_scales_offsets, merge_two_level, pack_sub_codes,
                                                   pack_superscales)
from quant_serve.kernels.matmul.reference import dequantize_w4, pack_int4_cols, pack_int4_rows, w4a16_matmul_ref
from quant_serve.kernels.matmul.rows.layout import W4A16Weights
from quant_serve.kernels.matmul.reference_int8 import act_group_size, w4a8_matmul_ref
from quant_serve.quant.layers.dense import DenseLinear, check_float
from quant_serve.quant.rtn import quantize_rtn


class QuantLinear(nn.Module):
    """INT4 weight-only linear in the internal layout (kernels/matmul/reference.py), N = sum(output_sizes).

    Each shard comes from one source module and is converted by the QuantConfig that built the layer. `finalize`
    concatenates the shards along N; shards whose act-order permutations differ stay separate sub-layers (`parts`)
    whose outputs are concatenated, since one input permutation cannot serve them all.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str, quant_config, group_size: int, source_prefixes: list[str] = ()):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.group_size = group_size if group_size > 0 else in_features
        self.has_bias = bias
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant_config = quant_config
        self.source_prefixes = list(source_prefixes) or [f"shard {i}" for i in range(len(output_sizes))]
        self.parts: nn.ModuleList | None = None
        self._shards: list = [None] * len(output_sizes)
        for name in ("qweight", "scales", "qzeros", "offsets", "superscales", "perm", "bias"):
            self.register_buffer(name, None)
        self.dummy_two_level = False       # init_dummy: GGUF Q4_K's two-level scales (set by GGUFConfig)
        self.packed: W4A16Weights | FragWeights | None = None   # the kernels' layout on CUDA (repacked at load)
        self.act_scale: str | None = None  # None: activations in the model dtype; "token" / "group": int8 (W4A8)

    def load_shard(self, shard_id: int, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{prefix}: shard {shard_id} out of range for output_sizes {self.output_sizes}")
        if self._shards[shard_id] is not None:
            raise ValueError(f"{prefix}: shard {shard_id} loaded twice")
        n = self.output_sizes[shard_id]
        # Convert on the target device: the repack is elementwise work that a GPU does in milliseconds.
        tensors = {name: t.to(self.device) for name, t in tensors.items()}
        w = self.quant_config.convert(tensors, prefix, self.in_features, n, self.group_size)
        if w.bias is not None and not self.has_bias:
            raise ValueError(f"{prefix}.bias present but the config says this layer has no bias")
        if self.has_bias and w.bias is None:
            raise ValueError(f"{prefix}.bias is missing: the config says this layer has a bias")
        if w.bias is not None and tuple(w.bias.shape) != (n,):
            raise ValueError(f"{prefix}.bias has shape {tuple(w.bias.shape)}, expected {(n,)}")
        if w.superscales is None:
            check_float(w.scales, f"{prefix} scales")
        if w.bias is not None:
            check_float(w.bias, f"{prefix}.bias")
        w.qweight = w.qweight.to(self.device).contiguous()
        if w.superscales is not None:              # GGUF Q4_K: int16 sub-codes, int32 super-scales, as stored
            w.scales, w.superscales = w.scales.to(self.device).contiguous(), w.superscales.to(self.device).contiguous()
        else:
            w.scales = w.scales.to(self.device, scale_dtype(w.scales.dtype, self.dtype)).contiguous()
        w.qzeros = None if w.qzeros is None else w.qzeros.to(self.device).contiguous()
        if w.offsets is not None:                  # GGUF: W = q * s + o, o in the scales' dtype rule
            w.offsets = w.offsets.to(self.device, scale_dtype(w.offsets.dtype, self.dtype)).contiguous()
        w.perm = None if w.perm is None else w.perm.to(self.device)
        w.bias = None if w.bias is None else w.bias.to(self.device, self.dtype)
        self._shards[shard_id] = w

    def finalize(self) -> None:
        if self._shards is None:
            return
        missing = [p for p, s in zip(self.source_prefixes, self._shards) if s is None]
        if missing:
            raise ValueError(f"quantized layer never received tensors for {', '.join(missing)}")
        perms = [s.perm for s in self._shards]
        if all(p is None for p in perms) or all(p is not None and torch.equal(p, perms[0]) for p in perms):
            self._set(self._shards)
        else:
            self.parts = nn.ModuleList()
            for n, prefix, shard in zip(self.output_sizes, self.source_prefixes, self._shards):
                part = QuantLinear(self.in_features, [n], self.has_bias, self.dtype, self.device,
                                   self.quant_config, self.group_size, [prefix])
                part._set([shard])
                self.parts.append(part)
        self._shards = None

    def _set(self, shards: list) -> None:
        """Concatenate converted shards along N into the layer's buffers (GGUF Q4_K's two-level scales:
        merge_two_level)."""
        self.superscales = merge_two_level(shards)                                   # [G/8, N] int32 or None
        dtypes = {s.scales.dtype for s in shards}
        sdtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.qweight = torch.cat([s.qweight for s in shards], dim=1)                 # [K/8, N]
        self.scales = torch.cat([s.scales.to(sdtype) for s in shards], dim=1)       # [G, N]
        if all(s.qzeros is None for s in shards):
            self.qzeros = None
        else:
            self.qzeros = torch.cat([s.qzeros if s.qzeros is not None else _eights(s.scales) for s in shards],
                                    dim=1)                                         # [G, N/8]
        self.offsets = None
        if any(s.offsets is not None for s in shards):
            if self.qzeros is not None or any(s.offsets is None for s in shards):
                raise ValueError(f"{', '.join(self.source_prefixes)}: a merged layer cannot mix float offsets "
                                 "(GGUF) with integer zero points")
            odtypes = {s.offsets.dtype for s in shards}
            odtype = odtypes.pop() if len(odtypes) == 1 else torch.float32
            self.offsets = torch.cat([s.offsets.to(odtype) for s in shards], dim=1)   # [G, N]
        self.perm = shards[0].perm
        self.bias = torch.cat([s.bias for s in shards]) if self.has_bias else None
        self._shards = None
        self._repack_for_kernels()

    def _repack_for_kernels(self) -> None:
        """On CUDA keep only the kernels' layout (one copy of the weights on the GPU)."""
        if self.device.type != "cuda":
            return
        # GGUF (float offsets): on an fp16 model scales and offsets in fp16, as checkpoints' scales are; Q4_K's fp32
        # products round to 11 significant bits there, and the layer reads 5 bits a weight instead of 6
        if self.superscales is not None:          # GGUF Q4_K two-level: nothing cast; the layout follows self.dtype
            self.packed = prepare_kernel_weights(self.qweight, self.scales, None, self.group_size, self.perm,
                                                 scale_dtype=self.dtype, superscales=self.superscales)
        else:
            self.packed = prepare_kernel_weights(self.qweight, self.scales, self.qzeros, self.group_size, self.perm,
                                                 self.offsets, None if self.offsets is None else
                                                 gguf_kernel_scale_dtype(self.scales.dtype, self.dtype))
        self.qweight = self.scales = self.qzeros = self.perm = self.offsets = self.superscales = None
        words = self.packed.words if isinstance(self.packed, FragWeights) else self.packed.qweight
        self.register_buffer("packed_qweight", words)                    # counted as a weight (memory, bench)
        self.register_buffer("packed_scales", self.packed.scales)
        self.register_buffer("packed_qzeros", self.packed.qzeros)
        self.register_buffer("packed_offsets", self.packed.offsets)
        self.register_buffer("packed_superscales", self.packed.superscales)

    @classmethod
    def round_to_nearest(cls, weight: torch.Tensor, group_size: int, dtype: torch.dtype, device,
                         name: str = "lm_head", rows_per_chunk: int = 8192) -> "QuantLinear":
        """An INT4 copy of a dense weight [N, K]: round-to-nearest, zero points, fp16 scales per group_size
        inputs (--quantize-lm-head). Quantized on `device` a chunk of rows at a time (rows are independent), so
        a 152k-row head needs ~0.5 GB of scratch, not four fp32 copies of itself."""
        n, k = weight.shape
        layer = cls(k, [n], False, dtype, device, None, group_size, [name])
        codes, scales, zeros = [], [], []
        for r in range(0, n, rows_per_chunk):
            q, s, z = quantize_rtn(weight[r:r + rows_per_chunk].to(device, torch.float32), 4, group_size, False,
                                   scale_dtype=torch.float16)
            codes.append(pack_int4_rows(q.t().contiguous()))                     # [K/8, n_c] packed along K
            scales.append(s.to(scale_dtype(torch.float16, dtype)))               # [G, n_c]
            zeros.append(z)                                                      # [G, n_c]
            del q
        layer.qweight, layer.scales = torch.cat(codes, dim=1), torch.cat(scales, dim=1)
        layer.qzeros = pack_int4_cols(torch.cat(zeros, dim=1))                  # [G, N/8]
        layer.perm, layer.bias, layer.offsets, layer._shards = None, None, None, None
        layer._repack_for_kernels()
        return layer

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random codes and scales (weights about N(0, 0.02)) for --load-format dummy; a GGUF layer gets float
        per-group offsets (-8 s, as Q4_0) in place of the symmetric zero point."""
        k, n, g = self.in_features, self.out_features, -(-self.in_features // self.group_size)
        codes = torch.randint(-2**31, 2**31, (k // 8, n), generator=gen, dtype=torch.int64, device=gen.device)
        self.qweight = codes.to(torch.int32).to(self.device)
        gguf = getattr(self.quant_config, "float_offsets", False)      # fp32 as a loaded Q4_K layer holds them
        self.scales = torch.full((g, n), 0.02 / 4.6, dtype=torch.float32 if gguf else self.dtype, device=self.device)
        self.offsets = -8 * self.scales if gguf else None
        self.superscales = None
        if self.dummy_two_level:      # Q4_K as stored: sc = m = 40, d = 0.02 / 4.6 / 40, dmin = 8 d (about as above)
            d = torch.full((-(-g // 8), n), 0.02 / 4.6 / 40, dtype=torch.float16, device=self.device)
            self.scales = pack_sub_codes(torch.full((g, n), 40, device=self.device),
                                         torch.full((g, n), 40, device=self.device))
            self.superscales = pack_superscales(d, 8 * d)
            self.offsets = None
        self.qzeros, self.perm, self.parts, self._shards = None, None, None, None
        self.bias = torch.zeros(n, dtype=self.dtype, device=self.device) if self.has_bias else None
        self._repack_for_kernels()

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 W [N, K] with K in the original input order (what nn.Linear would hold)."""
        if self.parts is not None:
            return torch.cat([p.dequantized_weight() for p in self.parts], dim=0)
        qweight, scales, qzeros, perm, offsets = self.qweight, self.scales, self.qzeros, self.perm, self.offsets
        if self.superscales is not None:
            scales, offsets = kquant_scales_offsets(scales, self.superscales)
        if self.packed is not None:
            qweight, scales, qzeros, _, perm, offsets = twin_args(self.packed)
        w = dequantize_w4(qweight, scales, qzeros, self.group_size, offsets=offsets)   # [K, N], internal order
        if perm is not None:
            w = torch.empty_like(w).index_copy_(0, perm, w)
        return w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if self.packed is not None:
            return w4a16_matmul(x, self.packed, bias=self.bias)
        scales, offsets = self.scales, self.offsets
        if self.superscales is not None:          # the CPU twin of Q4_K's two-level scales: their fp32 products
            scales, offsets = kquant_scales_offsets(scales, self.superscales)
        if self.act_scale is not None:
            return w4a8_matmul_ref(x, self.qweight, scales, self.qzeros, self.group_size,
                                   act_group_size(self.act_scale, self.in_features, self.group_size), self.perm,
                                   self.bias, offsets)
        return w4a16_matmul_ref(x, self.qweight, scales, self.qzeros, self.group_size, self.perm, self.bias, offsets)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """As DenseLinear.forward_silu_mul; on the kernel layout the GEMV's split-K reduce applies it (one launch
        fewer per layer at decode)."""
        hooked = self._forward_hooks or self._forward_pre_hooks      # eval's per-layer error hooks see [T, N]
        if self.parts is None and self.packed is not None and not hooked and self.act_scale is None:
            return w4a16_matmul(x, self.packed, bias=self.bias, silu_mul=True)
        return silu_and_mul(self(x))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_sizes={self.output_sizes}, group_size={self.group_size}, "
                f"bias={self.has_bias}, act_order={self.perm is not None or self.parts is not None}, "
                f"offsets={self.offsets is not None}, "
                f"two_level={self.superscales is not None or getattr(self.packed, 'superscales', None) is not None}")


def scale_dtype(checkpoint: torch.dtype, model: torch.dtype) -> torch.dtype:
    """Keep the checkpoint's scales when they match the model dtype, else fp32: never narrow fp16 scales to bf16."""
    return checkpoint if checkpoint == model else torch.float32


def gguf_kernel_scale_dtype(checkpoint: torch.dtype, model: torch.dtype) -> torch.dtype:
    """GGUF scales and offsets on CUDA: fp16 on an fp16 model (Q4_K / Q5_K / Q6_K's fp32 products rounded to 11
    bits, for fewer bytes a decode step); else scale_dtype's rule: a bf16 model (Gemma) would round them to 8 bits,
    coarser than Q8_0's or Q6_K's own steps."""
    return torch.float16 if model == torch.float16 else scale_dtype(checkpoint, model)


def _eights(scales: torch.Tensor) -> torch.Tensor:
    """Explicit z = 8 for a symmetric shard merged with asymmetric ones: [G, N/8]."""
    return pack_int4_cols(torch.full(tuple(scales.shape), 8, dtype=torch.int32, device=scales.device))


def make_linear(in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                device: torch.device | str, quant_config=None, source_prefixes: list[str] = ()) -> nn.Module:
    """The one place that decides which linear implementation a layer gets.

    quant_config: None for dense layers, or a quant.formats QuantConfig whose `make_linear(...)` decides per module,
    from the safetensors header, whether the source modules (source_prefixes, one per output shard, e.g. the q/k/v
    projections of a merged qkv layer) are quantized; it returns a DenseLinear for modules left unquantized.
    """
    if quant_config is not None:
        if not source_prefixes:
            raise ValueError("make_linear with a quant_config needs source_prefixes (checkpoint module names)")
        return quant_config.make_linear(in_features, output_sizes, bias, dtype, device, list(source_prefixes))
    return DenseLinear(in_features, output_sizes, bias, dtype, device)
