"""Split-K for the W4A16 kernels: how K is cut, where partials go, and the two ways they are summed.

two launches  every split stores its fp32 partial to a workspace [S, M, N]; `_splitk_reduce_kernel` sums them.
one launch    the same stores, then each program takes a ticket (atomic add on its output tile's counter); the
              program that draws the last ticket sums the S partials, adds the bias, writes the output and puts the
              counter back to 0. Both sum in split order 0..S-1 starting from split 0, so their results are
              bit-identical (and deterministic, whichever split arrives last).

Counters: one int32 per output tile in a buffer cached per device. It is allocated outside CUDA graph capture
(capture cannot allocate a buffer that outlives the graph) and is kept all-zero between kernels, because each
kernel resets the counters it used; kernels on one stream may therefore share it. Kernels running concurrently on
two streams must not (they would draw each other's tickets).
"""
import torch

from quant_serve.kernels.triton_compat import tl, triton
from quant_serve.kernels.pdl import launch_options, pdl_enabled, pdl_start, pdl_wait

_COUNTER_MIN = 1 << 16                       # int32s: 256 KB covers every tile grid the dispatcher launches
_COUNTERS: dict[tuple[str, int], list[torch.Tensor]] = {}


def split_plan(K: int, pack_k: int, split_k: int) -> tuple[int, int]:
    """(splits actually used, chunks per split): no split is left empty."""
    chunks = triton.cdiv(K, pack_k)
    per = triton.cdiv(chunks, max(1, min(split_k, chunks)))
    return triton.cdiv(chunks, per), per


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """All-zero int32 counters, at least `tiles` of them, for single-launch split-K on `device`."""
    key = (device.type, device.index if device.index is not None else
           (torch.cuda.current_device() if device.type == "cuda" else 0))
    bufs = _COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"W4A16 split-K needs {tiles} tile counters, more than allocated before CUDA graph "
                               f"capture; run the layer once outside capture first")
        size = max(_COUNTER_MIN, triton.next_power_of_2(tiles))
        # older buffers stay alive: graphs captured earlier still point at them
        bufs.append(torch.zeros(size, dtype=torch.int32, device=device))
    return bufs[-1]


@triton.jit
def _store_result(acc, out_ptr, ws_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, pid_k, n_splits, tile,
                  HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_LAUNCH: tl.constexpr):
    """acc fp32 [BM, BN] -> the output (bias, cast); with SPLIT, this split's slice of the workspace [S, M, N]
    and, with ONE_LAUNCH, the ticket: the last split of output tile `tile` finishes the sum."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    offs = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT:
        tl.store(ws_ptr + pid_k * M * N + offs, acc, mask=mask)
        if ONE_LAUNCH:
            # bar.sync, then one release by the ticket's thread: every thread's partial is ordered before it
            tl.debug_barrier()
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                # .cg: read the other splits' partials from L2, never from a stale L1 line
                total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in range(1, n_splits):
                    total += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
                _write_out(total, out_ptr, bias_ptr, offs_m, offs_n, N, mask, stride_om, HAS_BIAS)
                tl.store(cnt_ptr + tile, 0)                        # the next kernel finds its counters at 0
    else:
        _write_out(acc, out_ptr, bias_ptr, offs_m, offs_n, N, mask, stride_om, HAS_BIAS)


@triton.jit
def _write_out(acc, out_ptr, bias_ptr, offs_m, offs_n, N, mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "split_k"])
def _splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, split_k,
                          HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (+ bias): a second pass keeps split-K deterministic and needs no memset.
    SILU_MUL (N = 2I, gate | up): out [M, I] = silu(gate) * up, each half first rounded to out's dtype, as the
    unfused GEMV + silu_and_mul kernel computes it (bit-identical), one launch and one [M, 2I] round trip fewer."""
    pdl_start(PDL)
    pdl_wait(PDL)                     # the partials are the previous kernel's output (kernels/pdl.py)
    W: tl.constexpr = 2 if SILU_MUL else 1
    cols = N // W
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * cols
    m = offs // cols
    n = offs % cols
    src = m * N + n
    acc = tl.load(ws_ptr + src, mask=mask, other=0.0)
    for s in range(1, split_k):
        acc += tl.load(ws_ptr + s * M * N + src, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(ws_ptr + src + cols, mask=mask, other=0.0)
        for s in range(1, split_k):
            up += tl.load(ws_ptr + s * M * N + src + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            up += tl.load(bias_ptr + n + cols, mask=mask, other=0.0).to(tl.float32)
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
        acc = act.to(tl.float32) * up
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_splitk_reduce(ws: torch.Tensor, bias, out: torch.Tensor, split_k: int, silu_mul: bool = False) -> None:
    """ws fp32 [S, M, N] -> out [M, N], or [M, N/2] = silu(gate) * up with silu_mul."""
    M, cols = out.shape
    block = 1024
    pdl = pdl_enabled(ws)
    _splitk_reduce_kernel[(triton.cdiv(M * cols, block),)](
        ws, bias if bias is not None else ws, out, M, ws.shape[2], out.stride(0), split_k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, PDL=pdl, BLOCK=block, num_warps=4, **launch_options(pdl))


def split_buffers(x: torch.Tensor, M: int, N: int, splits: int, one_launch: bool, tiles: int, out_cols: int = 0):
    """-> (out [M, out_cols or N] in x's dtype, workspace fp32 [S, M, N] or out when S == 1, counters or out)."""
    out = torch.empty((M, out_cols or N), dtype=x.dtype, device=x.device)
    if splits == 1:
        return out, out, out
    ws = torch.empty((splits, M, N), dtype=torch.float32, device=x.device)
    return out, ws, tile_counters(x.device, tiles) if one_launch else out
