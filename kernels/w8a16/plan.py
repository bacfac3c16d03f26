"""Which W8A16 kernel runs, with which tile, and why (`plan_w8a16`): one pure function of the shape, the group size,
the weight layout and the GPU's SM count. The forward pass (dispatch.py), `quant-serve kernels --explain
--weight-format w8|q6k|q5k` and the benchmarks ask here, so what they report is what runs.

int8 codes (Q8_0, Q5_0 / Q5_1, mixed shards): at M = 1 / 16 on an H100 (bench/results/kernels-gguf-q8-h100.json,
the old rule's tile and its neighbours) 32-row steps and K split until about 10 programs an SM beat the first
rule's 64-row steps at about 4 (M = 1, at the tile and split the plan now picks: o 16.8 -> 15.4 us, gate_up
85.9 -> 63.2, down 59.6 -> 41.9; FP16 11.7, 92.8, 51.9; qkv's 16 splits were not timed, its 8 gave 17.1 against 24.0). Above 16 rows the old plan dequantized the whole matrix every call (Q8_0
Qwen2.5-7B at batch 32: 2226 tok/s against 8533 for Q4_0, e2e-gguf-q8-h100.json); 32 / 64-row tl.dot blocks
read the codes once per block instead. DOT_MAX_M and the 32 / 64-row blocks are not yet measured on a GPU.
Code planes (Q6_K, Q5_K): measured at M = 1 on an H100 over 64-160 tiles a layer (bench/results/
kernels-gguf-planes-h100.json, Qwen2.5-7B's v, down, head, gate_up): K split until about 10 programs an SM, the
split-K sum in one launch; Q6_K through tl.dot rows even at M = 1 (down 73.3 -> 45.9 us, head 417 -> 285,
v 11.0 -> 6.4 against the int8 rule), Q5_K one row a program over 128 columns (gate_up 136 -> 93 us, down 74 -> 57).
"""
from dataclasses import dataclass
from functools import lru_cache

GEMV_MAX_M = 16        # code planes: split-K GEMV up to here (decode, memory-bound); dequantize + cuBLAS above
DOT_MAX_M = 256        # int8 codes: the GEMV's tl.dot row blocks up to here; dequantize + cuBLAS above
FMA_MAX_M = 1          # one row a program with CUDA-core FMAs; more rows share each weight tile through tl.dot
_PROGRAMS_PER_SM = 10  # int8 codes: split K until tiles x splits reach about this many programs an SM
MAX_SPLIT = 16
_PLANES_PROGRAMS_PER_SM = 10   # the code-plane layouts: more loads in flight (measured, see above)
_PLANES_MAX_SPLIT = 32


@dataclass(frozen=True)
class W8A16Config:
    path: str                 # "gemv" | "dequant"
    block_m: int = 1          # gemv: 1 = one x row a program (FMA), 16 = up to 16 rows a program (tl.dot)
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1          # upper bound: the launcher never leaves a split empty
    num_warps: int = 4
    one_launch: bool = False  # split-K partials summed by the last split (splitk.py) instead of a second kernel


@dataclass(frozen=True)
class W8A16Plan:
    """kernel: "gemv" | "gemv-dot" | "dequant+cublas" | "torch" (the CPU twin); config: its tile; why: one line."""
    kernel: str
    config: W8A16Config | None
    why: str


@lru_cache(maxsize=4096)
def plan_w8a16(m: int, k: int, n: int, group_size: int, sms: int = 132, layout: str = "int8") -> W8A16Plan:
    """The kernel for x [M, K] @ W [K, N] on a GPU with `sms` SMs; layout "int8" (codes in groups of group_size),
    "q6k" or "q5k" (the code planes of q6k.py / q5k.py)."""
    if layout not in ("int8", "q6k", "q5k"):
        raise ValueError(f"unknown W8A16 layout {layout!r}: int8, q6k or q5k")
    if layout != "int8":
        return _dequant_plan(m, GEMV_MAX_M) if m > GEMV_MAX_M else _plan_planes(m, k, n, sms, layout)
    if m > DOT_MAX_M:
        return _dequant_plan(m, DOT_MAX_M)
    block_m = 1 if m <= FMA_MAX_M else 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 32
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // block_k)
    split = 1
    while split < MAX_SPLIT and tiles * split * 2 <= _PROGRAMS_PER_SM * sms and steps >= split * 4:
        split *= 2
    cfg = W8A16Config("gemv", block_m, block_n, block_k, split, 4)
    if block_m == 1:
        return W8A16Plan("gemv", cfg, f"M = {m}: split-K GEMV, one row a program, CUDA-core FMAs, {split} K "
                                      f"split(s) for {sms} SMs (group {group_size})")
    return W8A16Plan("gemv-dot", cfg, f"M = {m} <= {DOT_MAX_M}: split-K GEMV, {block_m}-row blocks share each "
                                      f"weight tile through tl.dot, {split} K split(s) for {sms} SMs "
                                      f"(group {group_size})")


def _dequant_plan(m: int, limit: int) -> W8A16Plan:
    return W8A16Plan("dequant+cublas", W8A16Config("dequant"),
                     f"M = {m} > {limit}: compute-bound, dequantize to the activation dtype once, then cuBLAS")


def _plan_planes(m: int, k: int, n: int, sms: int, layout: str) -> W8A16Plan:
    """Q6_K: 16-row quarters through tl.dot rows at every M <= 16, 64 columns; Q5_K: one row a program over 128
    columns at M = 1 (tl.dot rows above). K split until about _PLANES_PROGRAMS_PER_SM programs an SM (while each
    split keeps two 64-row chunks), summed in one launch."""
    dot = layout == "q6k" or m > FMA_MAX_M
    block_m, block_n = (16, 64) if dot else (1, 128)
    tiles = -(-m // block_m) * -(-n // block_n)
    steps = -(-k // 64)
    split = 1
    while split < _PLANES_MAX_SPLIT and tiles * split * 2 <= _PLANES_PROGRAMS_PER_SM * sms and steps >= split * 4:
        split *= 2
    cfg = W8A16Config("gemv", block_m, block_n, 64, split, 4, one_launch=split > 1)
    rows = "the rows share each weight tile through tl.dot (16-row block)" if dot else "one row a program, CUDA-core FMAs"
    return W8A16Plan("gemv-dot" if dot else "gemv", cfg,
                     f"M = {m}: {layout} planes, split-K GEMV, {rows}, {block_n} columns, {split} K split(s) for "
                     f"{sms} SMs in one launch (measured on an H100, kernels-gguf-planes-h100.json)")
