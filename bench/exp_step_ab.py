"""Experiment (GPU): a batch-1 decode step with one dispatch choice switched back, for A/B runs of
bench/profile_decode.py in alternating processes (one process per variant: the graphs capture the choice).

    for v in base no-preload base no-preload; do
        PYTHONPATH=. python bench/exp_step_ab.py $v --batches 1 --kv fp8 --out /tmp/p-$v.json; done

Variants: base (the rules as committed); no-merge-fold (the attention's split partials merged by their own
kernel, not by o_proj's x staging: QUANT_SERVE_FOLD_MERGE=0); cublas-head (the FP16 lm_head by cuBLAS, not
kernels/gemv.py: QUANT_SERVE_HEAD_GEMV=0); no-preload (qkv / o wait before requesting their later steps'
weights); no-cap (no register cap on gate_up's two splits); qkv-o-16-splits / o-16-splits (16 K splits of qkv
and o at M = 1 instead of the rule's 8); decode-8-splits (batch-1 attention in 8 context splits, not 16).
Results: bench/results/exp-preload-h200.json, exp-reg-cap-h200.json, exp-merge-fold-h200.json.
"""
import dataclasses
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quant_serve.kernels.w4a16_fold as fold  # noqa: E402
import quant_serve.kernels.w4a16_mma as mma  # noqa: E402
import quant_serve.kernels.w4a16_tuning as tuning  # noqa: E402


def no_preload() -> None:
    real = mma.w4a16_mma
    mma.w4a16_mma = lambda *args, **kwargs: real(*args, **dict(kwargs, preload=False))


def no_cap() -> None:
    tuning.one_wave_regs = lambda *args: 0


def splits_16(layers: tuple[int, ...]) -> None:
    """qkv (N = 4608) and / or o (N = 3584) of Qwen2.5-7B at M = 1 in 16 splits."""
    real = fold.select_mma_config

    def select(m, k, n, *args, **kwargs):
        cfg = real(m, k, n, *args, **kwargs)
        return dataclasses.replace(cfg, split_k=16) if m == 1 and k == 3584 and n in layers else cfg
    fold.select_mma_config = select


def decode_splits(count: int) -> None:
    """The batch-1 decode kernel (few programs) in `count` context splits instead of the rule's."""
    import quant_serve.kernels.paged_attention as attention
    real = attention.decode_config

    def config(is_fp8, programs, max_ctx, wide_table=False):
        cfg = real(is_fp8, programs, max_ctx, wide_table)
        return dataclasses.replace(cfg, num_splits=count) if programs <= 8 else cfg
    attention.decode_config = config


VARIANTS = {"base": lambda: None, "no-merge-fold": lambda: os.environ.update(QUANT_SERVE_FOLD_MERGE="0"),
            "cublas-head": lambda: os.environ.update(QUANT_SERVE_HEAD_GEMV="0"),
            "no-preload": no_preload, "no-cap": no_cap,
            "qkv-o-16-splits": lambda: splits_16((4608, 3584)), "o-16-splits": lambda: splits_16((3584,)),
            "decode-8-splits": lambda: decode_splits(8)}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: exp_step_ab.py {{{','.join(VARIANTS)}}} [bench/profile_decode.py arguments]")
    VARIANTS[sys.argv[1]]()
    sys.argv = ["bench/profile_decode.py"] + sys.argv[2:]
    runpy.run_path(str(Path(__file__).resolve().parent / "profile_decode.py"), run_name="__main__")
