"""Measured W4A16 dispatch: which path and tile per (M, K, N), per GPU family.

Tables come from bench/kernels.py --tune on the GPU named in each entry (see bench/NOTES-kernels.md); shapes not
in a table use the family's heuristic, whose constants were measured on the same runs.
"""
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class W4A16Config:
    path: str                 # "gemv" | "gemm" | "dequant"
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1          # upper bound: the launcher never leaves a split empty
    num_warps: int = 4
    num_stages: int = 3


def _c(path, bm=16, bn=128, sk=1, nw=4, ns=3) -> W4A16Config:
    return W4A16Config(path, bm, bn, sk, nw, ns)


# family -> heuristic constants and per-(K, N) lists of (largest M, config), M ascending. sm90: measured on an
# H200 (bench/results/kernels-tune-h200.json, bench/NOTES-kernels.md); the Qwen2.5-7B rows are that run's winners
# where the GPU, not the launch, set the time.
_SM90 = {
    "gemv_max_m": 1, "dequant_min_m": 129, "gemv_programs": 2048, "gemm_programs": 600, "max_split": 16,
    "shapes": {
        (3584, 37888): [(1, _c("gemv", 1, 64, 4)), (16, _c("gemm", 16, 256, 4, 8)), (32, _c("gemm", 32, 256, 4, 8)),
                        (64, _c("gemm", 64, 128, 2)), (128, _c("gemm", 64, 128, 2))],
        (18944, 3584): [(1, _c("gemv", 1, 64, 8)), (16, _c("gemm", 16, 256, 16, 8)), (32, _c("gemm", 32, 256, 8, 8)),
                        (64, _c("gemm", 64, 128, 8)), (128, _c("gemm", 128, 256, 8, 8))],
    },
}
TABLES: dict[str, dict] = {"sm90": _SM90, "default": dict(_SM90, shapes={})}


@lru_cache(maxsize=None)
def gpu_family(device_index: int) -> tuple[str, int]:
    """('sm90', number of SMs) for the CUDA device."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm{major}{minor}", torch.cuda.get_device_properties(device_index).multi_processor_count


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
    bm, bn = (16, 256) if m <= 16 else (32, 256) if m <= 32 else (64, 128)
    tiles = -(-m // bm) * -(-n // bn)
    return _c("gemm", bm, bn, _pow2_split(table["gemm_programs"], tiles, table["max_split"]), _warps(bm, bn))


def _warps(bm: int, bn: int) -> int:
    """Eight warps once a tile's weight words, double-buffered, would crowd four warps' registers."""
    return 8 if bn >= 256 or bm * bn > 64 * 128 else 4


def select_config(m: int, k: int, n: int, device: torch.device) -> W4A16Config:
    family, sms = gpu_family(device.index if device.index is not None else torch.cuda.current_device())
    table = TABLES.get(family, TABLES["default"])
    for m_max, cfg in table["shapes"].get((k, n), ()):
        if m <= m_max:
            return cfg
    return heuristic_config(m, k, n, table, sms)


def candidate_configs(m: int, k: int, n: int, pack_k: int = 128) -> list[W4A16Config]:
    """The search space bench/kernels.py --tune times for one (M, K, N); the winners fill TABLES."""
    chunks = -(-k // pack_k)
    splits = [s for s in (1, 2, 4, 8, 16) if s <= chunks]
    out = []
    if m <= 4:
        out += [_c("gemv", 1, bn, s, 4, 3) for bn in (64, 128, 256) for s in splits]
    bms = [16] if m <= 16 else [16, 32] if m <= 32 else [32, 64] if m <= 64 else [64, 128]
    for bm in bms:
        for bn in (64, 128, 256):
            out += [_c("gemm", bm, bn, s, _warps(bm, bn), 3) for s in (splits if m <= 128 else splits[:3])]
    if m >= 64:
        out.append(_c("dequant"))
    return out


def refinements(cfg: W4A16Config) -> list[W4A16Config]:
    """Pipelining depth and warp count around a winner."""
    if cfg.path == "dequant":
        return []
    from dataclasses import replace
    out = [replace(cfg, num_stages=s) for s in (2, 4)]
    out.append(replace(cfg, num_warps=8 if cfg.num_warps == 4 else 4))
    return out
