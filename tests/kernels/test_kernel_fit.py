"""Every kernel the plan picks fits the cards our users own, checked offline (no GPU): the W4A16 plan over the
Qwen2.5-7B and Llama-3.1-8B shapes for M = 1..8192, paged attention and the KV store on fp16 / fp8 e4m3 / e5m2
caches and on the integer caches (int8, int4 with its exact window), the other decode-step kernels, compiled for
sm80 (A100), sm86 (A10 / RTX 3090), sm89 (RTX 4090 / L4) and sm90 (H100 / H200) by tests/kernel_fit.py: each within its target's shared memory a block and registers, with
no instruction the target lacks (Hopper's TMA / wgmma / setmaxnreg / PDL wait before sm90, the fp8 conversions
before sm89)."""
import concurrent.futures

import pytest

from kernel_fit import in_fresh_process
from quant_serve.kernels.matmul.int8.rules import W4A8_AUTO_M

PROFILES = ("a100", "a10", "4090", "h200")
REGISTERS_PER_SM = 65536


@pytest.fixture(scope="module")
def reports() -> dict:
    """The four targets compiled two at a time (one per core of the CI machine), each in its own process."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(PROFILES, pool.map(in_fresh_process, PROFILES)))


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("profile", PROFILES)
def test_every_planned_kernel_fits_the_target(reports, profile):
    report = reports[profile]
    arch = tuple(report["arch"])
    names = {k["name"] for k in report["kernels"]}
    # the plan was walked and the decode step's kernels all compiled for this target
    assert {"_w4a16_mma_kernel", "_decode_kernel", "_prefill_kernel", "_store_kv_kernel", "_rope_store_kv_kernel",
            "_frag_dequant_kernel", "_rms_norm_kernel", "_gemv_kernel", "_w8a16_gemv_kernel",
            "_w8a16_dequant_kernel", "_int_store_kernel", "_int_attention_kernel"} <= names, names
    kinds = {p["kernel"] for p in report["w4a16_plans"]}
    assert ("tma" in kinds) == (arch == (9, 0)), kinds              # TMA only where the target has it
    # int8 activations: the quantize kernels and the int8 matmul's tiles compile everywhere (kernel_fit asks for
    # int8); "auto" takes them only in the measured bands of kernels/matmul/int8/rules.py
    assert {"_w4a8_mma_kernel", "_quant_group_kernel", "_quant_token_kernel"} <= names, names
    assert ("w4a8" in kinds) == (f"sm{arch[0]}{arch[1]}" in W4A8_AUTO_M), kinds
    assert {"gemv", "gemmt"} <= kinds, kinds                         # bf16 layers: the row layout's kernels
    for k in report["kernels"]:
        where = f"{profile}: {k['name']} ({k['num_warps']} warps)"
        assert k["shared"] <= report["smem_per_block"], f"{where} needs {k['shared']} B of shared memory"
        assert k["regs"] <= 255, f"{where}: {k['regs']} registers"
        assert k["regs"] * 32 * k["num_warps"] <= REGISTERS_PER_SM, f"{where}: one block does not fit an SM"
        if k["name"] == "_int_attention_kernel":   # the exact window's pipelined loop once took 172 KB on sm86
            assert k["stack"] <= 128, f"{where} spills {k['stack']} B"
        if arch < (9, 0):
            assert not k["hopper_sass"], f"{where} uses {k['hopper_sass']}"
        if arch < (8, 9):
            assert not k["fp8_cvt_sass"], f"{where} uses {k['fp8_cvt_sass']}"


@pytest.mark.slow
def test_the_checks_can_fail(reports):
    """The readings the checks above rest on are real: on sm90 the TMA kernel shows its Hopper instructions and
    takes more shared memory than an sm86 card has (planned there, it would fail the check), and the fp8 stores
    use the hardware conversion; on sm86 the same stores convert in software (no F2FP.*E4M3)."""
    h200, a10 = reports["h200"], reports["a10"]
    tma = [k for k in h200["kernels"] if k["name"] == "_w4a16_tma_kernel"]
    assert tma and all({"HGMMA", "UTMALDG"} <= set(k["hopper_sass"]) for k in tma)
    assert max(k["shared"] for k in tma) > a10["smem_per_block"]
    assert any("F2FP.SATFINITE.E4M3" in k["fp8_cvt_sass"] for k in h200["kernels"] if k["name"] == "_store_kv_kernel")
    assert not any(k["fp8_cvt_sass"] for k in a10["kernels"])
