"""The search space `bench/kernel_speed.py --tune` times for the row-layout kernels, and how its winners are written
back into rules.py's tables."""
from dataclasses import replace

from quant_serve.kernels.matmul.rules import W4A16Config, _c


def candidate_configs(m: int, k: int, n: int, pack_k: int = 128) -> list[W4A16Config]:
    """The search space bench/kernel_speed.py --tune times for one (M, K, N); the winners fill TABLES."""
    chunks = -(-k // pack_k)
    splits = [s for s in (1, 2, 4, 8, 16) if s <= chunks]
    out = []
    if m == 1:
        out += gemv_sweep(splits)
    elif m <= 4:
        out += [_c("gemv", 1, bn, s, 4 if bn < 256 else 8, 3) for bn in (64, 128, 256) for s in splits]
    if m <= 64:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        out += [_c("gemmt", bm, bn, s, 4 if bn < 256 else 8, 3) for bn in (64, 128, 256) for s in splits]
    if 8 <= m <= 128:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        out += [_c("gemm", bm, bn, s, 4 if bn < 256 else 8, 3) for bn in (128, 256) for s in splits[::2]]
    if m >= 128:
        out += [_c("gemm", bm, bn, s, 8, 3) for bm in (64, 128) for bn in (128, 256) for s in (1, 2)]
        out += [_c("gemmt", bm, 128, s, 8, 3) for bm in (64, 128) for s in (1, 2)]
        out.append(_c("dequant"))
    return out


def gemv_sweep(splits: list[int]) -> list[W4A16Config]:
    """M = 1: {register prefetch, cp.async pipeline of 2/3/4 stages} x BLOCK_N x warps x split, each split > 1
    with two launches and with one; plus wide tiles (BLOCK_N 256 in 16/32-row steps: 1 KB/512 B rows per program).
    Compiles: one per (loop, BLOCK_N, warps, rows, split > 1, one_launch); split_k itself only changes the grid."""
    loops = [dict(pipeline=False, ns=3)] + [dict(pipeline=True, ns=ns) for ns in (2, 3, 4)]
    out = []
    for lp in loops:
        for bn in (32, 64, 128):
            for nw in (2, 4, 8):
                for s in splits:
                    for one in ((False, True) if s > 1 else (False,)):
                        out.append(_c("gemv", 1, bn, s, nw, lp["ns"], pipeline=lp["pipeline"], one_launch=one))
    for lp in loops[:1] + loops[2:3]:
        for rows in (16, 32):
            for nw in (4, 8):
                for s in splits:
                    out.append(_c("gemv", 1, 256, s, nw, lp["ns"], pipeline=lp["pipeline"], one_launch=s > 1,
                                  rows=rows))
    return out


def table_row(k: int, n: int, winners: list[tuple[int, W4A16Config]]) -> str:
    """A `shapes` entry of the tables above, e.g. '(3584, 4608): [(1, _c("gemv", 1, 64, 8, 4, 3, pipeline=True))],'"""
    def call(c: W4A16Config) -> str:
        extra = "".join(f", {f}={getattr(c, f)!r}" for f in ("one_launch", "pipeline", "rows")
                        if getattr(c, f) != W4A16Config.__dataclass_fields__[f].default)
        return f'_c("{c.path}", {c.block_m}, {c.block_n}, {c.split_k}, {c.num_warps}, {c.num_stages}{extra})'
    return f"({k}, {n}): [" + ", ".join(f"({m}, {call(c)})" for m, c in winners) + "],"


def refinements(cfg: W4A16Config) -> list[W4A16Config]:
    """Pipelining depth and warp count around a winner."""
    if cfg.path == "dequant":
        return []
    out = [replace(cfg, num_stages=s) for s in (2, 4)]
    out.append(replace(cfg, num_warps=8 if cfg.num_warps == 4 else 4))
    return out
