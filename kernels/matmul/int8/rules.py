"""Where the W4A8 path runs: which weight formats it takes, which of them "auto" may give int8 activations (the
accuracy gate's table), the M bands by GPU family where it pays, and its tiles.

Triton-free: kernels/matmul/plan.py, `quant-serve kernels --explain` and the offline fit test read it.
"""
from dataclasses import dataclass

from quant_serve.kernels.gpu import GPUCaps, KernelOptions
from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_NONE

# weight formats the W4A8 kernel reads (kernels/matmul/int8/mma.py): INT4 codes with integer zero points or symmetric, in
# the fragment layout, groups a multiple of 64 rows (or one group)
W4A8_ZP_MODES = {ZP_INT4: "INT4 zero points (AWQ, GPTQ, compressed-tensors)", ZP_NONE: "symmetric INT4"}

# The accuracy half of "auto" is kernels/matmul/int8/eligibility.py, per weight format: quant/activations.py sets
# FragWeights.activation_dtype = "fp16" on the layers whose format has not met the gate, so that this plan sees
# "auto" only where int8 activations are accurate enough and decides by speed alone. "int8" runs any format in
# W4A8_ZP_MODES.

# GPU family -> the M band (lo, hi) where "auto" takes W4A8, from bench/w4a8_speed.py readings only. Families
# without an entry never take it on "auto". Empty: no GPU run of the W4A8 kernels exists yet.
W4A8_AUTO_M: dict[str, tuple[int, int]] = {}
# The bands expected to pay, not measured: above the W4A16 mma.sync band, where the sm80 / 86 / 89 plans dequantize
# the whole matrix for cuBLAS (0.51x FP16 at M = 256 under the a10 profile) and int8 tensor cores run at 2x (A10,
# L4, A100) or 4x (RTX 3090 / 4090, FP16 with FP32 accumulate) the FP16 rate. bench/w4a8_speed.py reports the plan
# these bands would give ("expected") beside the committed one, so that one run decides W4A8_AUTO_M.
W4A8_EXPECTED_M: dict[str, tuple[int, int]] = {"sm80": (65, 1 << 30), "sm86": (65, 1 << 30), "sm89": (65, 1 << 30)}
W4A8_GROUP_ROWS = 64          # the kernel's K steps: groups must be a multiple of this (or one group)


@dataclass(frozen=True)
class W4A8Config:
    """Tile of the W4A8 kernel: x rows and weight rows a program, K splits (two launches), warps (warps_m of them
    along the x rows, the rest along the weight rows, 16 rows each at least) and the activation scales ("token": one
    a row; "group": one a row and weight group)."""
    block_m: int = 128
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 8
    act_scale: str = "group"
    warps_m: int = 1


def int8_planned(caps: GPUCaps, options: KernelOptions) -> bool:
    """Whether any call on these caps may run the W4A8 kernels (their load-time probe is then worth its compile)."""
    return caps.tensor_cores and (options.activation_dtype == "int8" or
                                  options.activation_dtype == "auto" and caps.family in W4A8_AUTO_M)


def w4a8_takes(zp_mode: int, k: int, group_size: int) -> str:
    """'' where the W4A8 kernel reads these weights, else why not."""
    if zp_mode not in W4A8_ZP_MODES:
        return "the W4A8 kernel reads INT4 integer zero points or symmetric weights only"
    gs = k if group_size <= 0 else group_size
    if gs < k and gs % W4A8_GROUP_ROWS:
        return f"group size {gs} is not a multiple of {W4A8_GROUP_ROWS} (the W4A8 kernel's K step)"
    return ""


def select_w4a8_config(m: int, k: int, n: int, sms: int, act_scale: str = "group") -> W4A8Config:
    """128 x 128 tiles of 8 warps above 64 rows (one program an SM: 249 registers, offline sm86 / sm89 / sm90), fewer
    x rows below; K split until the grid covers the SMs, at least four 128-row steps a split."""
    bm = 128 if m > 64 else max(16, 1 << (m - 1).bit_length())
    bn, warps = 128, 8
    tiles = -(-m // bm) * -(-n // bn)
    steps = -(-k // 128)
    split = 1
    while tiles * split < sms and steps // (split * 2) >= 4:
        split *= 2
    return W4A8Config(bm, bn, split, warps, act_scale)


def plan_w4a8(m: int, k: int, n: int, caps: GPUCaps, options: KernelOptions, zp_mode: int,
              group_size: int) -> tuple[W4A8Config | None, str]:
    """(the tile, why) where this call's x goes to int8 (options.activation_dtype "int8" wherever the kernel reads
    the weights; "auto" in W4A8_AUTO_M's band), else (None, why not where "int8"
    was asked for, or "")."""
    if options.activation_dtype == "fp16":
        return None, ""
    why_not = "" if caps.tensor_cores else f"{caps.family} has no int8 mma.sync"
    why_not = why_not or w4a8_takes(zp_mode, k, group_size)
    if options.activation_dtype == "int8":
        if why_not:
            return None, f"int8 activations asked for, fp16 here: {why_not}"
        why = "activation_dtype int8"
    else:
        band = W4A8_AUTO_M.get(caps.family)
        if why_not or band is None or not band[0] <= m <= band[1]:
            return None, ""
        why = f"M >= {band[0]} on {caps.family}: int8 tensor cores beat fp16 ones (int8/rules.py W4A8_AUTO_M)"
    cfg = select_w4a8_config(m, k, n, caps.sms, options.act_scale)
    return cfg, (f"{why}: x quantized to int8 (a scale per {options.act_scale}), int8 mma.sync over the fragment "
                 f"layout, {cfg.split_k} K split(s) for {caps.sms} SMs")
