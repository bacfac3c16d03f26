"""Measured W4A16 dispatch: which path and tile per (M, K, N), per GPU family.

Tables come from bench/kernel_speed.py --tune on the GPU named in each entry (see docs/kernels.md); shapes not
in a table use the family's heuristic, whose constants were measured on the same runs.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class W4A16Config:
    path: str                 # "gemv" | "gemm" | "gemmt" (swapped operands) | "dequant"
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1          # upper bound: the launcher never leaves a split empty
    num_warps: int = 4
    num_stages: int = 3
    one_launch: bool = False  # split-K summed by the last split (atomic ticket) instead of a second kernel
    pipeline: bool = False    # gemv: loads in tl.range(num_stages) (cp.async ring) instead of the register prefetch
    rows: int = 0             # gemv: weight-tile rows per step; 0 = a whole chunk (pack_k/2)


def _c(path, bm=16, bn=128, sk=1, nw=4, ns=3, **variant) -> W4A16Config:
    return W4A16Config(path, bm, bn, sk, nw, ns, **variant)


# family -> heuristic constants and per-(K, N) lists of (largest M, config), M ascending. sm90: measured on an
# H200 (bench/results/kernels-tune-h200.json, graph-timed sweep; docs/kernels.md): the winners of every
# tuned point of the Qwen2.5-7B shapes (M in 1, 4, 16, 32, 64, 128, 256); the M=1 rows come from the later
# single-launch / pipelined gemv sweep (bench/results/kernels-tune-gemv-h200.json, 379 candidates per shape).
_SM90 = {
    "gemv_max_m": 1, "dequant_min_m": 128, "gemv_programs": 2048, "gemm_programs": 600, "max_split": 16,
    "shapes": {
        (3584, 4608): [(1, _c("gemv", 1, 64, 8, 2, 3, one_launch=True, pipeline=True)),
                       (16, _c("gemmt", 16, 64, 8)), (32, _c("gemmt", 32, 64, 8)), (64, _c("gemmt", 64, 128, 8))],
        (3584, 3584): [(1, _c("gemv", 1, 64, 16, 2, 2, one_launch=True, pipeline=True)),
                       (16, _c("gemmt", 16, 64, 8)), (32, _c("gemmt", 32, 64, 8)), (64, _c("gemmt", 64, 64, 8))],
        (3584, 37888): [(1, _c("gemv", 1, 64, 4, 2, 3, pipeline=True)), (4, _c("gemmt", 16, 128, 4, 8)),
                        (16, _c("gemmt", 16, 64, 4)), (32, _c("gemmt", 32, 64, 2, 4, 4)), (64, _c("gemmt", 64, 64, 2)),
                        (128, _c("gemmt", 128, 128, 1, 8, 4))],
        (18944, 3584): [(1, _c("gemv", 1, 64, 8, 2, 3, one_launch=True, pipeline=True)),
                        (16, _c("gemmt", 16, 64, 8)), (32, _c("gemmt", 32, 64, 8, 4, 4)),
                        (64, _c("gemmt", 64, 128, 8, 4, 4)), (128, _c("gemm", 128, 256, 8, 8))],
    },
}
# family -> (its table, where it was measured). Families with no table of their own use the sm90 heuristic's
# constants (not its per-shape winners, which were timed on the H200 only): derived, and configure() says so.
TABLES: dict[str, dict] = {"sm90": _SM90, "default": dict(_SM90, shapes={})}
MEASURED_ON = {"sm90": "H200 (bench/results/kernels-tune-h200.json, kernels-tune-gemv-h200.json)"}


def measured_on(family: str) -> str | None:
    """Where the W4A16 rules of a GPU family were measured, or None: derived from another family's."""
    return MEASURED_ON.get(family)


def _pow2_split(target_programs: int, tiles: int, max_split: int) -> int:
    split = 1
    while split < max_split and tiles * split * 2 <= target_programs:
        split *= 2
    return split


def heuristic_config(m: int, k: int, n: int, table: dict, sms: int) -> W4A16Config:
    """Enough programs to cover the GPU several times over: GEMV programs are light, GEMM ones heavy."""
    if m >= table["dequant_min_m"]:
        return _c("dequant")
    if m <= table["gemv_max_m"]:
        tiles = m * -(-n // 64)
        return _c("gemv", 1, 64, _pow2_split(table["gemv_programs"], tiles, table["max_split"]))
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    if m <= 64:                       # swapped operands, narrow N tiles: the winners of every tuned shape
        tiles = -(-m // bm) * -(-n // 64)
        return _c("gemmt", bm, 64, _pow2_split(table["gemm_programs"], tiles, table["max_split"]), 4)
    bn = 128
    tiles = -(-m // bm) * -(-n // bn)
    return _c("gemm", bm, bn, _pow2_split(table["gemm_programs"], tiles, table["max_split"]), _warps(bm, bn))


def _warps(bm: int, bn: int) -> int:
    """Eight warps once a tile's weight words, double-buffered, would crowd four warps' registers."""
    return 8 if bn >= 256 or bm * bn > 64 * 128 else 4


def select_config(m: int, k: int, n: int, family: str, sms: int) -> W4A16Config:
    """The row-layout kernel for [M, K] x [K, N] on a GPU family with `sms` SMs: the family's measured table, else
    its heuristic."""
    table = TABLES.get(family, TABLES["default"])
    for m_max, cfg in table["shapes"].get((k, n), ()):
        if m <= m_max:
            return cfg
    return heuristic_config(m, k, n, table, sms)


@dataclass(frozen=True)
class MMAConfig:
    """Tile of the fragment-layout tensor-core kernel (kernels/matmul/frag/mma.py): mma.sync up to M = 64, any M with
    wgmma (128-row tiles)."""
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    one_launch: bool = True
    wgmma: bool = False       # Hopper wgmma (x^T via shared memory): M = 17..128 on sm90 by the rule below
    max_regs: int = 0         # ptxas register cap a thread (0: the compiler's choice), set by one_wave_regs


MMA_MAX_M = 64          # mma.sync up to here
WGMMA_MAX_M = 128       # sm90: wgmma from M = 17 to here; above both, dequantize the fragment layout once + cuBLAS
_MMA_PROGRAMS = 640     # split-K until tiles x splits would pass this (about 5 per SM on 132 SMs)
REGISTERS_PER_SM = 65536    # sm80 .. sm90
MIN_REG_CAP = 56            # below it the M = 1 kernel spills (48: 10-14 registers, gate_up 21-47% slower than 56)


def one_wave_regs(programs: int, num_warps: int, sms: int) -> int:
    """The register cap a thread at which a grid of `programs` programs of num_warps warps is resident all at once
    (ptxas allocates registers by 8), or 0 where that takes fewer than MIN_REG_CAP or no cap at all (the kernel
    uses ~64 uncapped). Gate_up at M = 1 in two splits (1,184 programs, 66 registers: 7 an SM resident, a second
    wave of 260) runs 25.9 us uncapped and 21.1 capped at 56 (9 an SM), against 22.6 in one split
    (bench/results/exp-reg-cap-h200.json)."""
    per_sm = -(-programs // sms)
    regs = REGISTERS_PER_SM // (per_sm * 32 * num_warps) // 8 * 8
    return regs if MIN_REG_CAP <= regs < 64 else 0


def select_mma_config(m: int, k: int, n: int, wgmma: bool = False, silu_mul: bool = False,
                      sms: int = 132) -> MMAConfig | None:
    """Rule fitted to the H200 sweeps of bench/exp_mma.py (bench/results/exp-mma-h200.json, mma.sync at
    M = 1..64, 42-70 candidates per point; exp-mma-split16-h200.json, M = 1 with up to 16 splits;
    exp-mma-xstaged-h200.json, M = 1 with x staged in shared memory (64-column tiles, so also on wide layers
    unless the SwiGLU epilogue follows: bench/results/exp-swiglu-ab-h200.json);
    exp-mma-wgmma-h200.json, wgmma at M = 32..4096; Qwen2.5-7B shapes). mma.sync: 64-column tiles of 4 warps, 128 at
    M > 32; 16 splits for long K at M <= 8, at M = 9..16 5 on short K and 12 on long K
    (exp-mma-splits-h200.json), one on very wide layers (two at M = 1 where the SwiGLU follows or a
    register cap makes the grid one wave on `sms` SMs); two launches at M > 32.
    wgmma (wgmma=True: an sm90 GPU whose load probe passed) above M = 16: 64 columns x 4 warps up to M = 32, then
    128 x 8 warps, two launches. Otherwise K splits to ~600 programs. None: M is past both kernels (dequantize +
    cuBLAS)."""
    if wgmma and 16 < m <= WGMMA_MAX_M:
        bn, nw = (64, 4) if m <= 32 else (128, 8)
        return MMAConfig(bn, 128, _mma_split(n, bn), nw, False, wgmma=True)
    if m > MMA_MAX_M:
        return None
    if m <= 8:
        if k >= 8192:
            # long K, few columns (down): 16 splits of 128-row steps at M = 1; 14 at M = 2..8, where the x
            # buffers' 73 registers leave 6 programs an SM (down 13.1-13.9 us against 14.2-14.9 for the old ring
            # at 16, whose 15 splits would take a second wave: bench/results/exp-mma-bufs3-h200.json)
            return MMAConfig(64, 128, 16 if m == 1 else 14, 4, True)
        if n >= 16384:
            # M = 1: two splits (the SwiGLU gate_up's in the decode step: step 1.831 against 1.875 ms for 128 x 2,
            # 1.970 for one split, 1.893-1.905 for three or four, bench/results/exp-m1-splits-h200.json), their
            # registers capped where that makes the whole grid resident (gate_up 21.1 us against 25.9 uncapped
            # and 22.6 in one split; plain 20.4 against 22.2 in one split: exp-reg-cap-h200.json); a plain layer
            # the cap cannot bring into one wave keeps one split with x staged. M = 2..8: one split with the
            # SwiGLU in the epilogue, 23.7-24.1 us against 27.6-28.3 for 128 x 2 + reduce pass, 38.4-39.6 against
            # 43.2-43.7 as gate_up -> down (bench/results/exp-swiglu-small-m-h200.json)
            tiles = -(-n // 64)
            cap = one_wave_regs(tiles * 2, 4, sms)
            split = 2 if m == 1 and (silu_mul or cap) else 1
            return MMAConfig(64, 128, split, 4, True, max_regs=cap if split == 2 else 0)
        bn, bk = 64, 128
    elif m <= 16:
        # M = 9..16: 5 splits on short K, 12 on long K (the launcher's step counts: 6 and 13 steps a split), one on
        # very wide layers. qkv 7.3-7.7 against 7.6-8.1 us for the power of two, o 7.0 against 7.3, down 16.2-17.5
        # against 17.6-18.8, at M = 12 and 16, three rounds in turn (bench/results/exp-mma-splits-h200.json and
        # exp-mma-splits-depth-h200.json); M = 1..8 and gate_up: no split count or register cap beat the rule
        bn = 64
        split = (12 if k >= 8192 else 5) if -(-n // bn) * 2 <= _MMA_PROGRAMS else 1
        return MMAConfig(bn, 128, split, 4, True)
    elif m <= 32:
        bn, bk = 64, 128
    else:
        bn, bk = 128, 128
    return MMAConfig(bn, bk, _mma_split(n, bn), 4, m <= 32)


@dataclass(frozen=True)
class TMAConfig:
    """Tile of the TMA-fed Hopper kernel (kernels/matmul/frag/tma.py): consumer warpgroups a program (1: two programs an
    SM), weight rows and x rows a program, (one consumer) each step's dequant beside the last step's wgmma, K rows a
    step and the ring's stages. How the last partial wave is cut is the kernel's stream_k_plan."""
    consumers: int = 1
    block_n: int = 64
    block_m: int = 64
    overlap: bool = False
    block_k: int = 64
    stages: int = 4


TMA_MIN_M, TMA_MAX_M = 17, 4096    # sm90: the TMA kernel between these; dequantize + cuBLAS above


def select_tma_config(m: int, k: int, n: int, sms: int = 132) -> TMAConfig | None:
    """Rule fitted to the H200 sweeps of the stream-K kernel (bench/results/exp-tma-sk-h200.json: 1-2 consumer
    warpgroups, 64-256 weight rows, 64-256 x rows, stream-K program counts, M = 64..4096 on the Qwen2.5-7B shapes,
    against dequantize + cuBLAS in the same run; exp-tma-overlap-h200.json and exp-tma-reduce-h200.json: M = 16..1024
    with and without the overlap). At M = 16 mma.sync wins (gate_up 27.4 against 33.2 us); from 17 rows both pad
    to 32, where this kernel wins (gate_up 33.8 against 49.2 us, down 23.6 against 24.6).
    M <= 64: one consumer, x rows M rounded up to 32 or 64, 128 weight rows (64 on narrow short-K layers: o 9.7
    against 10.9 us); M <= 128: two consumers x 256 weight rows on wide layers (gate_up 59.6 us), else one x 64;
    narrow short-K layers up to M = 512 keep one consumer x 64 x 128 rows (o at 256: 17.8 against 19.4 us); else
    two consumers x 128 weight rows x 256 x rows, which share each x tile (0.98-1.04x FP16 in the sweep from M = 256
    on wide or long-K layers). One consumer overlaps each step's dequant with the last wgmma except on 64 weight
    rows x 32 or 64 x rows (o at M = 64: 9.9 against 10.4 us, at 32 8.2 against 9.0); it wins 1-7% elsewhere
    (gate_up at 64: 40.9 against 43.9, qkv at 512: 32.4 against 33.8). Steps of 128 K rows (half the steps, so half
    their barriers and waits; the ring then holds fewer stages) win on long-K layers to M = 64 (down at 32: 21.2
    against 24.9 us with 128 weight rows; at 64: 26.0 against 28.9 with 64 rows and the overlap) and on the wider
    narrow layer from 65 to 256 rows (qkv: 15.2 against 15.8 at 128, 23.1 against 24.3 at 256, two stages), not on
    o or gate_up (exp-tma-bk2-h200.json, each winner timed three times in turn with FP16). Above
    M = 4096 (unmeasured): dequantize + cuBLAS (None), within 3% of the kernel at 4096."""
    if not TMA_MIN_M <= m <= TMA_MAX_M:
        return None
    narrow = n <= 4608 and k <= 4096
    if m <= 64:
        if k > 4096:
            return TMAConfig(1, 128, 32, block_k=128) if m <= 32 else TMAConfig(1, 64, 64, True, block_k=128)
        bn, bm = 64 if narrow and n <= 4096 else 128, 32 if m <= 32 else 64
        return TMAConfig(1, bn, bm, overlap=bn == 128)
    if narrow and n > 4096 and m <= 256:
        return TMAConfig(1, 64, 128, block_k=128, stages=2)
    if m <= 128:
        return TMAConfig(2, 256, 128) if n >= 16384 else TMAConfig(1, 64, 128, overlap=True)
    if m <= 512 and narrow:
        return TMAConfig(1, 64, 128, overlap=True)
    return TMAConfig(2, 128, 256)


def _mma_split(n: int, bn: int) -> int:
    tiles = -(-n // bn)
    split = 1
    while split < 8 and tiles * split * 2 <= _MMA_PROGRAMS:
        split *= 2
    return split
