"""The decode kernel's split partials and where they are merged.

paged_decode splits a short batch's contexts across programs; each split leaves an unnormalized partial softmax
(o [B, Hq, S, D] fp32, its running max and sum in ml [B, Hq, S, 2], exp2 domain). merge_partials merges them in a
kernel of its own (attention_triton._decode_reduce_kernel). In the batch-1 decode step the merge is instead read by
o_proj's x staging (_merged_x inside kernels/matmul/frag/mma.py:_w4a16_mma_kernel): one launch and one grid wait a layer
fewer (lab log entry 24). merge_partials_ref is the torch twin of both.
"""
from dataclasses import dataclass

import torch

from quant_serve.kernels.triton_compat import gl, gluon
from quant_serve.kernels.pdl import launch_options, pdl_enabled

NEG: gl.constexpr = gl.constexpr(-1.0e30)    # attention_triton.NEG: the max an empty split stored


@dataclass
class DecodePartials:
    """paged_decode(merge=False)'s output: o [B, Hq, S, D] fp32, ml [B, Hq, S, 2] fp32 (max, sum); seq_lens [B] and
    tile (the decode's context tile) say which splits hold tokens (the others stored m = NEG, l = 0, o = 0);
    query_start_loc [B + 1] the output row of each sequence; out [T, Hq, D] the buffer the merge writes (its dtype
    is the attention output's); v_scale (fp8 KV: a float or a 0-d tensor on the device) multiplies the merge."""
    o: torch.Tensor
    ml: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    out: torch.Tensor
    tile: int
    v_scale: torch.Tensor | float | None

    @property
    def splits(self) -> int:
        return self.o.shape[2]

    @property
    def features(self) -> int:
        """Hq * D: the merged row's length (o_proj's K)."""
        return self.o.shape[1] * self.o.shape[3]


def scale_args(scale, dummy: torch.Tensor):
    """A KV scale as kernel arguments (pointer, value, from_pointer): a tensor scale is read on the device, so no
    host sync happens. The attention kernels (kernels/attention/paged.py) pass theirs the same way."""
    if isinstance(scale, torch.Tensor):
        return scale, 1.0, True
    return dummy, float(scale), False


def merge_partials(p: DecodePartials) -> torch.Tensor:
    """The split partials merged, one query head a program -> p.out [T, Hq, D]."""
    from quant_serve.kernels.attention.triton_kernels import _decode_reduce_kernel
    batch, num_q_heads, splits, block_d = p.o.shape
    vs_ptr, vs_val, from_ptr = scale_args(1.0 if p.v_scale is None else p.v_scale, p.out)
    pdl = pdl_enabled(p.o)
    _decode_reduce_kernel[(batch, num_q_heads)](
        p.o, p.ml, p.query_start_loc, p.out, vs_ptr, vs_val, num_q_heads, p.out.shape[2], splits,
        p.out.stride(0), p.out.stride(1), SPLITS_P2=1 << (splits - 1).bit_length(), BLOCK_D=block_d,
        IS_FP8=p.v_scale is not None, SCALE_PTR=from_ptr, PDL=pdl, num_warps=4, **launch_options(pdl))
    return p.out


def merge_partials_ref(p: DecodePartials) -> torch.Tensor:
    """Torch twin: -> [T, Hq, D] in p.out's dtype (rows of p.out not owned by a sequence stay as they are)."""
    m, l = p.ml[..., 0], p.ml[..., 1]                                           # [B, Hq, S]
    w = torch.exp2(m - m.amax(-1, keepdim=True))
    merged = (p.o * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]           # [B, Hq, Dp]
    if p.v_scale is not None:
        merged = merged * (p.v_scale.float() if isinstance(p.v_scale, torch.Tensor) else p.v_scale)
    out = p.out.clone()
    out[p.query_start_loc[:-1].long()] = merged[..., :out.shape[2]].to(out.dtype)
    return out


def live_splits(seq_len: int, splits: int, tile: int) -> int:
    """_live_splits' twin: the splits of a seq_len-token context that hold tokens."""
    per = max(1, -(-(-(-seq_len // splits)) // tile) * tile)
    return -(-seq_len // per)


@gluon.jit
def _live_splits(sl_ptr, SPLITS: gl.constexpr, TILE: gl.constexpr):
    """How many of the decode's SPLITS splits hold tokens of sequence 0: its splits are whole TILE-token tiles of
    cdiv(seq_len, SPLITS) tokens (attention_triton._decode_kernel); the rest stored empty partials."""
    seq_len = gl.load(sl_ptr)
    per = gl.maximum((((seq_len + SPLITS - 1) // SPLITS) + TILE - 1) // TILE * TILE, 1)
    return (seq_len + per - 1) // per


@gluon.jit
def _merged_x(o_ptr, ml_ptr, vs_ptr, vs_val, k0, count, live, SPLITS: gl.constexpr, D: gl.constexpr,
              X: gl.constexpr, SCALE: gl.constexpr, num_warps: gl.constexpr):
    """Sequence 0's attention output at [k0, k0 + X) of its Hq * D row (k0 % 4 == 0), merged from the live splits'
    partials as _decode_reduce_kernel merges them (the sum over splits in split order, not a tree: fp32 rounding
    apart), 0 at and past count. SCALE: 0 none, 1 vs_val, 2 the fp32 at vs_ptr. -> [X / 4, 4] fp32, row-major.
    Each thread holds four neighbours of one head, so a split's max and sum are one load a thread; every split's
    loads are independent (the loop unrolls): one L2 round trip."""
    gl.static_assert(D % 4 == 0)
    L: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [num_warps, 1], [1, 0])
    quad = k0 + 4 * gl.arange(0, X // 4, layout=gl.SliceLayout(1, L))          # [X / 4]: a thread's first k
    row = (quad // D) * SPLITS                            # the head's split 0 in o [Hq, S, D], ml [Hq, S, 2]
    cols = gl.arange(0, 4, layout=gl.SliceLayout(0, L))
    mask = (quad - k0) < count
    d = (quad % D)[:, None] + cols[None, :]                                    # [X / 4, 4]
    mx = gl.full([X // 4], NEG, gl.float32, gl.SliceLayout(1, L))
    for s in gl.static_range(SPLITS):
        mx = gl.maximum(mx, gl.load(ml_ptr + (row + s) * 2, mask=mask & (s < live), other=NEG))
    num = gl.zeros([X // 4, 4], gl.float32, L)
    den = gl.zeros([X // 4], gl.float32, gl.SliceLayout(1, L))
    for s in gl.static_range(SPLITS):
        on = mask & (s < live)
        w = gl.exp2(gl.load(ml_ptr + (row + s) * 2, mask=on, other=NEG) - mx)
        num += gl.load(o_ptr + ((row + s) * D)[:, None] + d, mask=on[:, None], other=0.0) * w[:, None]
        den += gl.load(ml_ptr + (row + s) * 2 + 1, mask=on, other=0.0) * w
    out = num / gl.where(mask, den, 1.0)[:, None]
    if SCALE == 1:
        out = out * vs_val
    elif SCALE == 2:
        out = out * gl.load(vs_ptr).to(gl.float32)
    return out


def merge_args(p: DecodePartials) -> tuple[tuple, dict]:
    """The w4a16_mma kernel's merge arguments for p (M = 1: one sequence): (ml_ptr, sl_ptr, vs_ptr, vs_val) and
    the MERGE_* constexprs."""
    vs_ptr, vs_val, from_ptr = scale_args(1.0 if p.v_scale is None else p.v_scale, p.o)
    return (p.ml, p.seq_lens, vs_ptr, vs_val), dict(
        MERGE_SPLITS=p.splits, MERGE_D=p.o.shape[3], MERGE_TILE=p.tile,
        MERGE_SCALE=0 if p.v_scale is None else 2 if from_ptr else 1)
