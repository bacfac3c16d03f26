"""What the kernels may assume about a GPU (a capability record), the options the engine sets for them, and the
record each CUDA device runs under.

Every kernel choice reads `runtime_for(device)`: the GPU's `GPUCaps` (measured from the device, or a named profile
of the cards our users own, which the H200 can run to emulate them: no TMA / wgmma / PDL, a 99 KB shared-memory
budget, grids sized for their SM count) and the engine's `KernelOptions`. The engine sets both once at build
(`configure`); nothing in kernels/ reads the environment. Torch-only: importing this needs no Triton and no GPU.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from quant_serve.kernels.w4a16.rules import measured_on

KB = 1024


@dataclass(frozen=True)
class GPUCaps:
    """One GPU as the kernel plan sees it. smem_per_block: the most shared memory one block may opt in to."""
    name: str
    arch: tuple[int, int]          # compute capability
    sms: int
    smem_per_block: int            # bytes
    l2_bytes: int
    bandwidth_gbs: float           # DRAM bandwidth, GB/s (datasheet for profiles)
    memory_gib: float
    tma: bool                      # bulk tensor copies (sm90)
    wgmma: bool                    # warpgroup MMA (sm90a)
    pdl: bool                      # programmatic dependent launch (sm90+)
    fp8_cvt: bool                  # hardware fp8 <-> fp16 conversion (cvt.*.e4m3x2: sm89+)
    profile: str = "this"          # the named profile these caps came from, or "this" (the device itself)
    # The card model's rates (engine/card_model.py), datasheet dense (non-sparse) figures; 0 = unknown / none.
    boost_mhz: int = 0             # boost clock
    fp16_f32acc_tflops: float = 0.0    # FP16 tensor cores, FP32 accumulation (our kernels, cuBLAS)
    fp16_tflops: float = 0.0       # FP16 tensor cores, FP16 accumulation
    int8_tops: float = 0.0         # INT8 tensor cores (int32 accumulation)
    fp8_tflops: float = 0.0        # FP8 tensor cores, FP32 accumulation (0: the card has none)

    @property
    def family(self) -> str:
        return f"sm{self.arch[0]}{self.arch[1]}"

    @property
    def tensor_cores(self) -> bool:
        """mma.sync with fp16 operands and fp32 accumulators (sm80+)."""
        return self.arch >= (8, 0)


def _caps(name, arch, sms, smem_kb, l2_mb, gbs, gib, profile, rates: tuple = (0, 0.0, 0.0, 0.0, 0.0)) -> GPUCaps:
    """rates: (boost MHz, FP16 TFLOPS with FP32 accumulation, FP16 TFLOPS with FP16 accumulation, INT8 TOPS,
    FP8 TFLOPS), as in GPUCaps."""
    hopper = arch >= (9, 0)
    mhz, f16_f32, f16, i8, f8 = rates
    return GPUCaps(name, arch, sms, smem_kb * KB, l2_mb * KB * KB, gbs, gib, tma=hopper, wgmma=arch == (9, 0),
                   pdl=hopper, fp8_cvt=arch >= (8, 9), profile=profile, boost_mhz=mhz, fp16_f32acc_tflops=f16_f32,
                   fp16_tflops=f16, int8_tops=i8, fp8_tflops=f8)


# Datasheet figures of the cards our users own (and the ones we measure on). smem: the per-block opt-in maximum
# (sm86 / sm89: 99 KB, sm80: 163 KB, sm90: 227 KB). rates (the card model's): boost MHz, then dense tensor rates
# FP16 with FP32 accumulation, FP16 with FP16 accumulation, INT8, FP8 (0: none). GeForce cards run FP16 with FP32
# accumulation at half the FP16-accumulate rate; the data-centre cards run both at full rate. Each rate is
# SMs x boost x the architecture's dense ops per SM-clock (1,024 FP16 on sm86 / sm89, 2,048 on sm80; H100 / H200's
# 989 TFLOPS is 4,096 at 1,830 MHz, below the 1,980 MHz boost).
#   A10: NVIDIA A10 datasheet (FP16 tensor 125 TF, INT8 250 TOPS dense; 600 GB/s); 72 SMs, 1,695 MHz.
#   RTX 3090: NVIDIA Ampere GA102 whitepaper, table "GeForce RTX 3090" (FP16 tensor 142 TF FP16 acc. / 71 TF FP32
#     acc., INT8 284 TOPS dense; 936 GB/s; 82 SMs, 1,695 MHz).
#   RTX 4090: NVIDIA Ada Lovelace (AD102) whitepaper, table "GeForce RTX 4090" (FP16 tensor 330.3 / 165.2 TF, FP8
#     330.3 TF FP32 acc., INT8 660.6 TOPS dense; 1,008 GB/s; 128 SMs, 2,520 MHz).
#   L4: NVIDIA L4 datasheet (FP16 242 / FP8 485 / INT8 485 with sparsity: 121 / 242.5 / 242.5 dense; 300 GB/s);
#     58 SMs, 2,040 MHz.
#   A100 SXM4 80GB: NVIDIA A100 datasheet (FP16 312 TF, INT8 624 TOPS dense; 2,039 GB/s); 108 SMs, 1,410 MHz.
#   H100 SXM5 / H200: NVIDIA H100 and H200 datasheets (FP16 989 TF, FP8 and INT8 1,979 dense; 3.35 / 4.8 TB/s);
#     132 SMs, 1,980 MHz.
PROFILES: dict[str, GPUCaps] = {
    "a10": _caps("NVIDIA A10", (8, 6), 72, 99, 6, 600, 24, "a10", (1695, 125.0, 125.0, 250.0, 0.0)),
    "3090": _caps("NVIDIA GeForce RTX 3090", (8, 6), 82, 99, 6, 936, 24, "3090", (1695, 71.0, 142.0, 284.0, 0.0)),
    "4090": _caps("NVIDIA GeForce RTX 4090", (8, 9), 128, 99, 72, 1008, 24, "4090",
                  (2520, 165.2, 330.3, 660.6, 330.3)),
    "l4": _caps("NVIDIA L4", (8, 9), 58, 99, 48, 300, 24, "l4", (2040, 121.0, 121.0, 242.5, 242.5)),
    "a100": _caps("NVIDIA A100-SXM4-80GB", (8, 0), 108, 163, 40, 2039, 80, "a100", (1410, 312.0, 312.0, 624.0, 0.0)),
    "h100": _caps("NVIDIA H100 80GB HBM3", (9, 0), 132, 227, 50, 3350, 80, "h100",
                  (1980, 989.4, 989.4, 1978.9, 1978.9)),
    "h200": _caps("NVIDIA H200", (9, 0), 132, 227, 60, 4800, 141, "h200", (1980, 989.4, 989.4, 1978.9, 1978.9)),
}
PROFILE_NAMES = ("this", *PROFILES)
ACTIVATION_DTYPES = ("auto", "fp16", "int8")


def caps_of_device(index: int) -> GPUCaps:
    """The capability record of a CUDA device, read off the device (bandwidth, clock and tensor rates from the
    closest profile of its architecture, which the device does not report)."""
    props = torch.cuda.get_device_properties(index)
    arch = (props.major, props.minor)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * KB
    l2 = getattr(props, "L2_cache_size", 0)
    known = [c for c in PROFILES.values() if c.arch == arch and c.name == props.name] or \
            [c for c in PROFILES.values() if c.arch == arch]
    gbs = known[0].bandwidth_gbs if known else 0.0
    rates = (known[0].boost_mhz, known[0].fp16_f32acc_tflops, known[0].fp16_tflops, known[0].int8_tops,
             known[0].fp8_tflops) if known else (0, 0.0, 0.0, 0.0, 0.0)
    return _caps(props.name, arch, props.multi_processor_count, smem // KB, l2 // (KB * KB), gbs,
                 props.total_memory / KB ** 3, "this", rates)


@dataclass(frozen=True)
class KernelOptions:
    """The engine's kernel switches, set at build from EngineConfig (each on by default where the GPU has it).
    profile: "this" (the device as it is) or a name in PROFILES, whose caps the kernels then assume (a profile of
    an older card on a newer GPU emulates it: no TMA / wgmma / PDL, its shared memory and SM count)."""
    profile: str = "this"
    pdl: bool = True               # programmatic dependent launch on the decode path (sm90)
    tma: bool = True               # the TMA-fed W4A16 kernel for M = 17..4096 (sm90)
    frag_layout: bool = True       # fp16 INT4 layers in the fragment layout (tensor-core kernels from M = 1)
    fold_norms: bool = True        # batch 1: RMSNorms folded into the INT4 matmuls around them
    fold_merge: bool = True        # batch 1: o_proj merges the decode attention's split partials
    head_gemv: bool = True         # one-row FP16 lm_head through the Triton GEMV instead of cuBLAS
    compile_workers: int = 16      # threads compiling kernels at start (kernels/precompile.py); < 2: one by one
    # verification graphs attend as one decode row per token (the decode kernel's context splits) instead of the
    # varlen prefill kernel (engine/spec/graphs.py): at k = 4, context 512, Qwen2.5-7B AWQ the step costs 1.11x /
    # 1.39x a decode step at batch 1 / 4 against 1.32x / 1.47x (H100; H200 batch 1: 1.04x vs 1.26x); the prefill
    # kernel wins only at batch 16, where speculation is off (bench/results/spec-verify-cost-{h100,batch1-h200}.json)
    verify_rows: bool = True
    # activations of the quantized layers: "fp16" (W4A16 kernels), "int8" (quantized on the fly and multiplied on
    # integer tensor cores wherever the plan has such a kernel), "auto" (int8 where the plan says it pays and the
    # weight format passed the accuracy gate)
    activation_dtype: str = "auto"
    act_scale: str = "group"       # int8 activations: one scale per token ("token") or per token and weight group

    def __post_init__(self):
        if self.profile not in PROFILE_NAMES:
            raise ValueError(f"unknown GPU profile {self.profile!r}; choose one of {', '.join(PROFILE_NAMES)}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"unknown activation dtype {self.activation_dtype!r}; choose one of "
                             f"{', '.join(ACTIVATION_DTYPES)}")
        if self.act_scale not in ("token", "group"):
            raise ValueError(f"unknown activation scale granularity {self.act_scale!r}; choose token or group")


@dataclass(frozen=True)
class KernelRuntime:
    """What the kernels of one device run under: its capabilities (as the profile makes them) and the options."""
    caps: GPUCaps
    options: KernelOptions = field(default_factory=KernelOptions)

    @property
    def pdl(self) -> bool:
        return self.caps.pdl and self.options.pdl

    @property
    def tma(self) -> bool:
        return self.caps.tma and self.options.tma


def resolve_caps(device_caps: GPUCaps, profile: str) -> GPUCaps:
    """The caps the kernels assume on a device: its own, or the profile's where the device can run that profile's
    kernels (a profile never claims features the device lacks)."""
    if profile == "this":
        return device_caps
    p = PROFILES[profile]
    if p.arch > device_caps.arch:
        raise ValueError(f"the {profile} profile (sm{p.arch[0]}{p.arch[1]}) needs a newer GPU than "
                         f"{device_caps.name} ({device_caps.family})")
    return replace(p, tma=p.tma and device_caps.tma, wgmma=p.wgmma and device_caps.wgmma,
                   pdl=p.pdl and device_caps.pdl, fp8_cvt=p.fp8_cvt and device_caps.fp8_cvt,
                   smem_per_block=min(p.smem_per_block, device_caps.smem_per_block))


_RUNTIMES: dict[int, KernelRuntime] = {}
_logger = logging.getLogger("quant_serve")


def configure(device: torch.device | int, options: KernelOptions) -> KernelRuntime:
    """Set the runtime of a CUDA device from the engine's options (at build, before any weight is prepared)."""
    index = _index(device)
    runtime = KernelRuntime(resolve_caps(caps_of_device(index), options.profile), options)
    _RUNTIMES[index] = runtime
    family = runtime.caps.family
    where = measured_on(family)
    if options.profile != "this":
        _logger.info("kernels on cuda:%d assume the %s profile (%s, %d SMs, %d KB shared memory a block; TMA %s, "
                     "wgmma %s, PDL %s)", index, options.profile, family, runtime.caps.sms,
                     runtime.caps.smem_per_block // KB, runtime.caps.tma, runtime.caps.wgmma, runtime.caps.pdl)
    if where is None:
        _logger.warning("no kernel table was measured on %s (%s): the W4A16 rules for it are derived, not measured",
                        runtime.caps.name, family)
    return runtime


def runtime_for(device: torch.device | int) -> KernelRuntime:
    """The runtime of a CUDA device: as configured, else the device's own caps with the default options."""
    index = _index(device)
    runtime = _RUNTIMES.get(index)
    if runtime is None:
        runtime = _RUNTIMES[index] = KernelRuntime(caps_of_device(index))
    return runtime


def options_for(device: torch.device) -> KernelOptions:
    """The kernel options a tensor's device runs under (the defaults off the GPU)."""
    return runtime_for(device).options if device.type == "cuda" else KernelOptions()


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def device_sms(device: torch.device) -> int:
    """SMs the kernels size their grids for: the runtime's (a profile's on an emulating GPU); 132 off the GPU."""
    if device.type != "cuda":
        return 132
    return runtime_for(device).caps.sms
