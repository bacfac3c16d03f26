"""Which W8A16 kernel runs, with which tile, and why (`plan_w8a16`): one pure function of the shape, the group size
and the GPU's SM count. The forward pass (dispatch.py), `quant-serve kernels --explain --weight-format w8` and the
benchmarks ask here, so what they report is what runs.

Not yet measured on a GPU: the constants below are derived from the W4A16 GEMV's (rules.py: ~4 programs an SM for
a memory-bound GEMV, power-of-two K splits up to 16) and from the W8A16 byte budget (a 64 x 64 int8 tile is 4 KB a
step, the FMA accumulator 32 fp32 registers a thread at 4 warps). bench/kernel_speed.py --weights q8_0 times them.
"""
from dataclasses import dataclass
from functools import lru_cache

GEMV_MAX_M = 16        # split-K GEMV up to here (decode, memory-bound); dequantize + cuBLAS above
FMA_MAX_M = 1          # one row a program with CUDA-core FMAs; 2..16 rows share each weight tile through tl.dot
_PROGRAMS_PER_SM = 4   # split K until tiles x splits reach about this many programs an SM
MAX_SPLIT = 16


@dataclass(frozen=True)
class W8A16Config:
    path: str                 # "gemv" | "dequant"
    block_m: int = 1          # gemv: 1 = one x row a program (FMA), 16 = up to 16 rows a program (tl.dot)
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1          # upper bound: the launcher never leaves a split empty
    num_warps: int = 4
    one_launch: bool = False  # split-K partials summed by the last split (splitk.py) instead of a second kernel
    q6_quarters: bool = False  # Q6_K planes: 16-row quarters (kernels.py Q6 2) instead of 32-row halves


@dataclass(frozen=True)
class W8A16Plan:
    """kernel: "gemv" | "gemv-dot" | "dequant+cublas" | "torch" (the CPU twin); config: its tile; why: one line."""
    kernel: str
    config: W8A16Config | None
    why: str


@lru_cache(maxsize=4096)
def plan_w8a16(m: int, k: int, n: int, group_size: int, sms: int = 132) -> W8A16Plan:
    """The kernel for x [M, K] @ W [K, N] (int8 codes in groups of group_size) on a GPU with `sms` SMs."""
    if m > GEMV_MAX_M:
        return W8A16Plan("dequant+cublas", W8A16Config("dequant"),
                         f"M = {m} > {GEMV_MAX_M}: compute-bound, dequantize to the activation dtype once, then "
                         "cuBLAS")
    block_m = 1 if m <= FMA_MAX_M else 16
    block_n, block_k = 64, 64
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // block_k)
    split = 1
    while split < MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * sms and steps >= split * 4:
        split *= 2
    cfg = W8A16Config("gemv", block_m, block_n, block_k, split, 4)
    if block_m == 1:
        return W8A16Plan("gemv", cfg, f"M = {m}: split-K GEMV, one row a program, CUDA-core FMAs, {split} K "
                                      f"split(s) for {sms} SMs (group {group_size}; derived, not measured)")
    return W8A16Plan("gemv-dot", cfg, f"M = {m} <= {GEMV_MAX_M}: split-K GEMV, the rows share each weight tile "
                                      f"through tl.dot (16-row block), {split} K split(s) for {sms} SMs "
                                      f"(group {group_size}; derived, not measured)")
