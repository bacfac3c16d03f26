"""GGUF weight formats on the Qwen2.5-7B layer shapes: the kernel the plan picks for each format against FP16 cuBLAS
(bench/kernel_speed.py --weights ...; the timer is kernel_speed's graph_us, CUDA-graph replay over rotated weight
copies that exceed the L2).

  python bench/kernel_speed.py --weights gguf-q4_k --out bench/results/kernels-gguf-q4_k-h200.json
  python bench/kernel_speed.py --weights q8_0,q6_k --ms 1,4,16,64 --out bench/results/kernels-gguf-w8-h200.json
  python bench/kernel_speed.py --weights awq-g128,gguf-q4_k,gguf-q4_k-f16,gguf-q6_k,q6_k --ms 1,16,64,256 \
      --out bench/results/kernels-gguf-kquant-h200.json      (Q4_K two-level next to AWQ g128 and the old layout)
  python bench/kernel_speed.py --weights gguf-q5_k,q5_k --ms 1,4,16,64 --out bench/results/kernels-gguf-q5_k-h100.json

Formats (how the GGUF loader lays them out, kernels/matmul/reference.py and kernels/matmul/reference_planes.py):
  gguf-q4_0   INT4, groups of 32, w = (q - 8) d: symmetric, no offsets (the zero-point path)
  gguf-q4_1   INT4, groups of 32, w = q d + m: float offsets
  gguf-q4_k   INT4, Q4_K's two-level scales as stored (kernels/matmul/frag/kquant.py: int16 sub-codes per 32, fp16 d and
              dmin per 256; 4.625 bits a weight): what the loader builds for a layer of Q4_K shards
  gguf-q4_k-f16  INT4, groups of 32, fp16 scale + fp16 offset per group (5 bits; Q4_K before the two-level layout,
              and a Q4_K shard merged with another INT4 type)
  awq-g128    INT4, groups of 128, packed int4 zero points (AWQ's layout: the issue-33 target)
  q8_0        int8 codes, groups of 32, no offsets (W8A16)
  q6_k        int8 codes (q - 32), groups of 16, no offsets (W8A16; 9 bits: Q6_K before the planes, and a Q6_K
              shard merged with another type)
  gguf-q6_k   Q6_K's 6-bit planes + int8 sub-scales + fp16 d (kernels/matmul/planes/q6k.py, 6.5625 bits; the W8A16
              kernels): what a layer of Q6_K shards keeps on the CPU and in bf16 models
  gguf-q6_k-frag  Q6_K in the W4A16 fragment layout (kernels/matmul/frag/q6k.py, 7 bits; the W4A16 tensor-core
              kernels): what a CUDA fp16 model makes of a layer of Q6_K shards at load
  gguf-q5_k-frag  Q5_K in the W4A16 fragment layout (kernels/matmul/frag/q5k.py, 6 bits: fp16 (s, o) per 32; the W4A16
              tensor-core kernels): what a CUDA fp16 model makes of a layer of Q5_K shards at load
  q5_k        int8 codes, groups of 32, float offsets (W8A16; 9 bits: Q5_K before the planes, and a Q5_K shard
              merged with a non-K type)
  gguf-q5_k   Q5_K's 5-bit planes + Q4_K's two-level scales (kernels/matmul/planes/q5k.py, 5.625 bits; the W8A16 kernels):
              what the loader builds for a layer of Q5_K shards
Every timed call is first checked against the dequantized weights through FP16 cuBLAS (rel_err in the row).
The 8-bit formats' GEMV (M <= 16, constants derived, not measured: kernels/matmul/plan.py) is also timed in a few
other tiles (row["variants_us"]: one scale row a step with block_k = the group, wider columns, longer steps); the
4-bit formats' M = 1 mma.sync kernel with and without the PDL preload and the one-wave register cap, two choices
derived offline for groups of 32 (kernels/matmul/frag/mma.py: no preload; the cap spills 96-104 bytes at 56 registers).
"""
import dataclasses

import torch

from quant_serve.kernels.matmul.dispatch import (call_plan, prepare_kernel_weights, prepare_q5k, prepare_q6k, w4a16_forward,
                                                 w8a16_forward)
from quant_serve.kernels.matmul.frag.q5k import frag5_bytes
from quant_serve.kernels.matmul.frag.q6k import frag6_bytes
from quant_serve.kernels.matmul.frag.kquant import kquant_bytes, kquant_scales_offsets, pack_sub_codes, pack_superscales
from quant_serve.kernels.matmul.reference import dequantize_w4, pack_int4_cols, pack_int4_rows
from quant_serve.kernels.matmul.plan import plan_w8a16
from quant_serve.kernels.matmul.planes.q5k import pack_q5k, q5k_bytes, q5k_dequantize
from quant_serve.kernels.matmul.planes.q6k import pack_q6k, q6k_bytes, q6k_dequantize
from quant_serve.kernels.matmul.reference_planes import dequantize_w8

# format -> (bits, group size, float offsets)
FORMATS = {"gguf-q4_0": (4, 32, False), "gguf-q4_1": (4, 32, True), "gguf-q4_k": (4, 32, True),
           "gguf-q4_k-f16": (4, 32, True), "awq-g128": (4, 128, False), "gguf-q6_k": (6, 16, False),
           "gguf-q6_k-frag": (6, 16, False), "gguf-q5_k-frag": (5, 32, True),
           "gguf-q5_k": (5, 32, True), "q8_0": (8, 32, False), "q6_k": (8, 16, False), "q5_k": (8, 32, True)}
PLANES = (5, 6)        # bits of the plane layouts (Q5_K, Q6_K): one 64-row chunk a GEMV step


def _w4(fmt: str) -> bool:
    """Whether the format runs the W4A16 kernels (the INT4 formats, Q6_K in the fragment layout)."""
    return FORMATS[fmt][0] == 4 or fmt.endswith("-frag")


def _int4_special(fmt: str, k: int, n: int, device: str) -> dict:
    """gguf-q4_k (two-level scales) and awq-g128 (packed zero points) layers, prepared as the loader does."""
    qweight = pack_int4_rows(torch.randint(0, 16, (k, n), device=device))
    if fmt == "awq-g128":
        groups = k // 128
        scales = (torch.rand(groups, n, device=device) * 0.002 + 0.0005).half()
        zeros = torch.randint(0, 16, (groups, n), device=device)
        qzeros = pack_int4_cols(zeros)
        w = prepare_kernel_weights(qweight, scales, qzeros, 128)
        dense = dequantize_w4(qweight, scales, qzeros, 128, torch.float16)
        nbytes = k * n // 2 + groups * n * 2 + groups * n // 2
    else:
        groups = k // 32
        sub = pack_sub_codes(torch.randint(1, 64, (groups, n), device=device),
                             torch.randint(0, 64, (groups, n), device=device))
        d = (torch.rand(groups // 8, n, device=device) * 4e-5 + 1e-5).half()
        sup = pack_superscales(d, (d.float() * 8).half())
        w = prepare_kernel_weights(qweight, sub, None, 32, scale_dtype=torch.float16, superscales=sup)
        scales, offsets = kquant_scales_offsets(sub, sup)
        dense = dequantize_w4(qweight, scales, None, 32, torch.float32, offsets).half()
        nbytes = kquant_bytes(k, n)
    return {"call": lambda x, c=None: w4a16_forward(x, w, None, c), "weights": w, "dense": dense, "nbytes": nbytes}


def random_layer(fmt: str, k: int, n: int, device: str = "cuda") -> dict:
    """A random layer of the format, in the loader's layout, prepared as at load -> {call(x), dense fp16 [K, N],
    nbytes (weights + scales + offsets)}."""
    if fmt in ("gguf-q4_k", "awq-g128"):
        return _int4_special(fmt, k, n, device)
    if fmt in ("gguf-q6_k", "gguf-q6_k-frag"):
        codes = torch.randint(-32, 32, (k, n), device=device)
        sub = torch.randint(-127, 128, (k // 16, n), device=device, dtype=torch.int8)
        q6 = pack_q6k(codes, sub, (torch.rand(k // 256, n, device=device) * 2e-5 + 1e-5).half())
        if fmt == "gguf-q6_k-frag":
            fw = prepare_q6k(q6, torch.float16)
            return {"call": lambda x, c=None: w4a16_forward(x, fw, None, c), "weights": fw,
                    "dense": q6k_dequantize(q6).half(), "nbytes": frag6_bytes(k, n)}
        return {"call": lambda x, c=None: w8a16_forward(x, q6, None, None, 16, None, c),
                "dense": q6k_dequantize(q6).half(), "nbytes": q6k_bytes(k, n), "group_size": 16}
    if fmt in ("gguf-q5_k", "gguf-q5_k-frag"):
        sub = pack_sub_codes(torch.randint(1, 64, (k // 32, n), device=device),
                             torch.randint(0, 64, (k // 32, n), device=device))
        d = (torch.rand(k // 256, n, device=device) * 4e-5 + 1e-5).half()
        q5 = pack_q5k(torch.randint(0, 32, (k, n), device=device), sub, pack_superscales(d, (d.float() * 16).half()))
        if fmt == "gguf-q5_k-frag":
            fw = prepare_q5k(q5, torch.float16)
            return {"call": lambda x, c=None: w4a16_forward(x, fw, None, c), "weights": fw,
                    "dense": q5k_dequantize(q5).half(), "nbytes": frag5_bytes(k, n)}
        return {"call": lambda x, c=None: w8a16_forward(x, q5, None, None, 32, None, c),
                "dense": q5k_dequantize(q5).half(), "nbytes": q5k_bytes(k, n), "group_size": 32}
    bits, gs, has_offsets = FORMATS[fmt]
    groups = k // gs
    scales = (torch.rand(groups, n, device=device) * 0.002 + 0.0005).half()
    offsets = (-scales.float() * 8 * torch.rand(groups, n, device=device)).half() if has_offsets else None
    extra = scales.numel() * 2 * (2 if has_offsets else 1)
    if bits == 4:
        qweight = pack_int4_rows(torch.randint(0, 16, (k, n), device=device))
        w = prepare_kernel_weights(qweight, scales, None, gs, offsets=offsets)
        dense = dequantize_w4(qweight, scales, None, gs, torch.float16, offsets)
        return {"call": lambda x, c=None: w4a16_forward(x, w, None, c), "weights": w, "dense": dense,
                "nbytes": k * n // 2 + extra}
    codes = torch.randint(-128, 128, (k, n), dtype=torch.int8, device=device)
    dense = dequantize_w8(codes, scales, offsets, gs, torch.float16)
    return {"call": lambda x, c=None: w8a16_forward(x, codes, scales, offsets, gs, None, c), "dense": dense,
            "nbytes": k * n + extra, "group_size": gs}


def _layout(fmt: str) -> str:
    """The W8A16 plan's layout argument for a format."""
    return {"gguf-q6_k": "q6k", "gguf-q5_k": "q5k"}.get(fmt, "int8")


def planned(fmt: str, layer: dict, x: torch.Tensor, sms: int) -> tuple[str, str]:
    """(kernel, config) the plan runs for x on this layer."""
    if _w4(fmt):
        p = call_plan(x, layer["weights"])
    else:
        p = plan_w8a16(x.shape[0], x.shape[1], layer["dense"].shape[1], layer["group_size"], sms, _layout(fmt))
    return p.kernel, repr(p.config)


def bench_format(fmt: str, shapes: dict, ms: list[int], graph_us, copies, sms: int, log) -> dict:
    """{layer: [row per M]}: row = m, kernel, config, ours_us, fp16_us, speedup over FP16, GB/s of ours, rel_err."""
    out = {}
    for name, (k, n) in shapes.items():
        layer0 = random_layer(fmt, k, n)
        layers = [layer0] + [random_layer(fmt, k, n) for _ in range(copies(layer0["nbytes"]) - 1)]
        fp16 = [layer["dense"].t().contiguous() for layer in layers[: copies(k * n * 2)]]      # [N, K]
        rows = []
        for m in ms:
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            want = torch.nn.functional.linear(x.float(), layer0["dense"].t().float())
            got = layer0["call"](x).float()
            err = ((got - want).norm() / want.norm()).item()
            kernel, config = planned(fmt, layer0, x, sms)
            row = {"m": m, "kernel": kernel, "config": config, "rel_err": err}
            if err > 5e-3:
                row["error"] = f"rel_err {err:.2e} against the dequantized weights: not timed"
            else:
                row["ours_us"] = graph_us([lambda layer=layer: layer["call"](x) for layer in layers])
                row["fp16_us"] = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in fp16])
                row["speedup_vs_fp16"] = row["fp16_us"] / row["ours_us"]
                row["ours_GBps"] = layer0["nbytes"] / row["ours_us"] / 1e3
                if not _w4(fmt) and FORMATS[fmt][0] in PLANES + (8,) and m <= 16:
                    row["variants_us"] = w8_variants(fmt, layers, x, want, graph_us, sms)
                if _w4(fmt) and kernel == "mma.sync" and m == 1:
                    row["variants_us"] = w4_m1_variants(layers, x, want, graph_us, name == "gate_up")
            log(f"{fmt} {name} M={m}: {row}")
            rows.append(row)
        out[name] = rows
        del layers, fp16
        torch.cuda.empty_cache()
    return out


def w8_variants(fmt: str, layers: list, x: torch.Tensor, want: torch.Tensor, graph_us, sms: int) -> dict:
    """{config: us} for GEMV tiles around the plan's, each checked first (rel_err > 5e-3: the error instead)."""
    gs = FORMATS[fmt][1]
    k, n = layers[0]["dense"].shape
    base = plan_w8a16(x.shape[0], k, n, gs, sms, _layout(fmt)).config
    out = {}
    tiles = [(bk, bn, nw, base.block_m) for bk, bn, nw in ((gs, 64, 4), (gs, 128, 4), (128, 64, 4), (64, 128, 8),
                                                            (64, 32, 2))]
    if x.shape[0] > 1:                       # the rows one a program (FMA) instead of through tl.dot
        tiles.append((base.block_k, base.block_n, base.num_warps, 1))
    splits = sorted({base.split_k, max(1, base.split_k // 2), min(16, base.split_k * 2)})
    extra = [{}]
    if FORMATS[fmt][0] in PLANES:            # Q5_K / Q6_K planes: one 64-row chunk a step
        tiles = [(64, bn, nw, bm) for bn, nw in ((64, 4), (128, 4), (128, 8), (256, 8))
                 for bm in ((1, 16) if x.shape[0] == 1 else (16,))]
        splits = sorted({max(1, base.split_k // 4), max(1, base.split_k // 2), base.split_k, base.split_k * 2,
                         base.split_k * 4})
        extra = [dict(one_launch=o) for o in (False, True)]
    for bk, bn, nw, bm in tiles:
        for split in splits:
            for more in extra:
                cfg = dataclasses.replace(base, block_k=bk, block_n=bn, num_warps=nw, split_k=split, block_m=bm,
                                          **more)
                got = layers[0]["call"](x, cfg).float()
                err = ((got - want).norm() / want.norm()).item()
                out[repr(cfg)] = graph_us([lambda layer=layer: layer["call"](x, cfg) for layer in layers]) \
                    if err <= 5e-3 else f"rel_err {err:.2e}"
    return out


def w4_m1_variants(layers: list, x: torch.Tensor, want: torch.Tensor, graph_us, silu_layer: bool) -> dict:
    """{"preload=..., max_regs=...": us} for the planned M = 1 mma.sync tile (the plain matmul; gate_up's tile is
    the SwiGLU one's), each checked first."""
    from quant_serve.kernels.matmul.frag.mma import w4a16_mma
    from quant_serve.kernels.matmul.rules import select_mma_config
    w0 = layers[0]["weights"]
    cfg = select_mma_config(1, w0.in_features, w0.out_features, False, silu_layer)
    out = {}
    for preload in (None, True):
        for cap in sorted({cfg.max_regs, 0}):
            def call(w, preload=preload, cap=cap):
                return w4a16_mma(x, w, None, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.one_launch,
                                 max_regs=cap, preload=preload)
            err = ((call(w0).float() - want).norm() / want.norm()).item()
            key = f"preload={preload}, max_regs={cap}"
            out[key] = graph_us([lambda w=layer["weights"]: call(w) for layer in layers]) if err <= 5e-3 else \
                f"rel_err {err:.2e}"
    return out


def summarize(result: dict) -> dict:
    """{format: {m: sum over the layers of ours_us and fp16_us, and their ratio}} (points timed on every layer)."""
    summary = {}
    for fmt, layers in result.items():
        by_m = {}
        for rows in layers.values():
            for r in rows:
                if "ours_us" in r:
                    t = by_m.setdefault(r["m"], {"ours_us": 0.0, "fp16_us": 0.0, "layers": 0})
                    t["ours_us"] += r["ours_us"]
                    t["fp16_us"] += r["fp16_us"]
                    t["layers"] += 1
        summary[fmt] = {m: dict(t, speedup_vs_fp16=t["fp16_us"] / t["ours_us"]) for m, t in by_m.items()
                        if t["layers"] == len(layers)}
    return summary
