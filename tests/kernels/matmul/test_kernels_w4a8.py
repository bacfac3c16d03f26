"""The W4A8 path (kernels/w4a8): the activation-quantization kernel against the twin (bit for bit, the interpreter on
CPU), the integer A operand the Gluon kernel forms from fragment words (emulated in torch: it must hold the codes
in x_q's K order), the Gluon kernel and the dispatcher against the twin (GPU), the plan's int8 decisions, and the
kernel's sm86 / sm89 / sm90 compile (integer MMAs, no spills, one barrier a step)."""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from quant_serve.kernels.gpu import PROFILES, KernelOptions  # noqa: E402
from quant_serve.kernels.interpret import patch_triton_interpreter  # noqa: E402
from quant_serve.kernels.matmul.frag.layout import ZP_INT4, ZP_NONE, ZP_OFFSETS, frag_words, prepare_frag  # noqa: E402
from quant_serve.kernels.matmul.plan import plan_w4a16  # noqa: E402
from quant_serve.kernels.matmul.int8.quant import frag_k_order, quantize_act, quantize_act_ref  # noqa: E402
from quant_serve.kernels.matmul.reference_int8 import quantize_activations, w4a8_matmul_ref  # noqa: E402
from quant_serve.kernels.matmul.int8.rules import W4A8_AUTO_M, W4A8Config, select_w4a8_config  # noqa: E402
from kernel_helpers import make_weights, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
patch_triton_interpreter()


def int8_operand_rows(words: torch.Tensor) -> torch.Tensor:
    """What the kernel's A tile holds, emulated: fragment words int32 [N/16, Kp/64 * 128] -> int32 [N, Kp], row n
    position p = the byte of `w & 0x0F0F0F0F` (rows g) or `(w >> 4) & 0x0F0F0F0F` (rows g + 8) that mma.sync
    m16n8k32 reads as A[n, p]: word (nt, kb, lane 4g + t, kt) byte i -> (16 nt + 8 b1 + g, 64 kb + 16 kt + 4t + i)."""
    nt16, w = words.shape
    wd = words.view(nt16, w // 128, 8, 4, 4)                                       # nt, kb, g, t, kt
    halves = torch.stack([wd & 0x0F0F0F0F, (wd >> 4) & 0x0F0F0F0F], dim=1)         # nt, b1, kb, g, t, kt
    bytes_ = torch.stack([(halves >> (8 * i)) & 0xFF for i in range(4)], dim=-1)   # ..., i
    return bytes_.permute(0, 1, 3, 2, 5, 4, 6).reshape(nt16 * 16, w // 2)          # nt b1 g | kb kt t i


def test_frag_k_order_permutes_inside_16_channels():
    order = frag_k_order(128)
    assert sorted(order.tolist()) == list(range(128))
    assert ((order // 16) == torch.arange(128) // 16).all()
    # position 4t + 2 b0 + b2 holds channel 2t + b0 + 8 b2
    assert order[:16].tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


def test_fragment_bytes_are_the_codes_in_x_q_order():
    """The key identity: the int8 bytes of the fp16 fragment words are an m16n8k32 A operand whose K order is
    frag_k_order, so the integer dot with x_q stored in that order is the twin's exact sum."""
    kp, n = 192, 48
    codes = torch.randint(0, 16, (kp, n), generator=torch.Generator().manual_seed(0))
    a = int8_operand_rows(frag_words(codes))
    assert torch.equal(a, codes[frag_k_order(kp)].t())
    x = torch.randn(5, kp, generator=torch.Generator().manual_seed(1))
    xq, _ = quantize_activations(x, kp)
    xq_perm, _ = quantize_act_ref(x, kp, kp)
    assert torch.equal(xq_perm.long() @ a.t().long(), xq.long() @ codes.long())


@pytest.mark.parametrize("m,k,kp,act_group", [(3, 256, 256, 64), (2, 200, 256, 64), (4, 384, 384, 128),
                                              (3, 200, 256, 200), (2, 1100, 1152, 1100), (5, 160, 192, 32)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantize_kernel_matches_twin_bit_for_bit(m, k, kp, act_group, dtype):
    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :16] = 0                                      # a zero block (token: a row with zeros) gets scale 1
    x[-1, 5] = 300                                     # an outlier
    if act_group < k:
        x[1, :act_group] = 0
    xq, sx = quantize_act(x.to(DEV), kp, act_group)
    xq_ref, sx_ref = quantize_act_ref(x, kp, act_group)
    assert torch.equal(xq.cpu(), xq_ref) and torch.equal(sx.cpu(), sx_ref)


def test_quantize_kernel_ties_round_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 58], dtype=torch.float16)   # s = 1
    xq, sx = quantize_act(x.to(DEV), 64, 64)
    assert sx.item() == 1.0
    assert xq.cpu()[0, frag_k_order(64).argsort()[:6]].tolist() == [127, 0, 2, 2, 0, -2]


def test_plan_takes_int8_where_the_rules_say():
    qkv = (3584, 4608)
    for gpu in ("a10", "4090", "h100"):
        caps = PROFILES[gpu]
        band = W4A8_AUTO_M.get(caps.family)
        for m in (1, 16, 64, 65, 256, 4096):
            auto = plan_w4a16(m, *qkv, caps, KernelOptions())
            assert (auto.kernel == "w4a8") == (band is not None and band[0] <= m <= band[1]), (gpu, m, auto)
            assert plan_w4a16(m, *qkv, caps, KernelOptions(activation_dtype="fp16")).kernel != "w4a8"
            forced = plan_w4a16(m, *qkv, caps, KernelOptions(activation_dtype="int8", act_scale="token"))
            assert forced.kernel == "w4a8" and forced.config.act_scale == "token", forced
    a10 = PROFILES["a10"]
    # formats and groups the kernel does not read keep fp16 activations and say why
    for kwargs, reason in ((dict(zp_mode=ZP_OFFSETS), "integer zero points"), (dict(group_size=32), "group size 32")):
        p = plan_w4a16(256, *qkv, a10, KernelOptions(activation_dtype="int8"), **kwargs)
        assert p.kernel != "w4a8" and reason in p.why, p
        assert plan_w4a16(256, *qkv, a10, KernelOptions(), **kwargs).kernel != "w4a8"
    assert plan_w4a16(256, *qkv, a10, KernelOptions(activation_dtype="int8"), zp_mode=ZP_NONE).kernel == "w4a8"
    assert plan_w4a16(256, *qkv, a10, KernelOptions(), dtype=torch.bfloat16).kernel == "dequant+cublas"
    assert plan_w4a16(256, *qkv, a10, KernelOptions(activation_dtype="int8"), layout="rows").kernel != "w4a8"


def test_w4a8_tiles_cover_the_sms():
    assert select_w4a8_config(4096, 3584, 37888, 72) == W4A8Config(128, 128, 1, 8, "group", 1)
    cfg = select_w4a8_config(256, 3584, 4608, 132)                # 72 tiles: two K splits fill 132 SMs
    assert (cfg.block_m, cfg.split_k) == (128, 2)
    assert select_w4a8_config(16, 18944, 3584, 72).block_m == 16


def _case(k, n, group_size, zeros, m, seed=0):
    qweight, scales, qzeros, gs, _ = make_weights(k, n, group_size, zeros, False, torch.float16, seed=seed)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    return prepare_frag(qweight, scales, qzeros, gs), x, (qweight, scales, qzeros, gs)


def _twin(x, raw, act_group, bias=None):
    qweight, scales, qzeros, gs = raw
    return w4a8_matmul_ref(x.cpu().float(), qweight.cpu(), scales.cpu().float(),
                           None if qzeros is None else qzeros.cpu(), gs, act_group,
                           bias=None if bias is None else bias.cpu().float())


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,group_size,zeros", [(512, 256, 128, True), (384, 160, 64, False),
                                                  (200, 48, -1, True), (3584, 4608, 128, True)])
@pytest.mark.parametrize("m", [1, 5, 16, 64, 65, 130, 256])
def test_gpu_w4a8_matches_twin(k, n, group_size, zeros, m):
    """Every tile shape the plan and the sweep use (x rows 16..128, 64..256 weight rows, K splits), per-group and
    per-token scales, bias; rows past M, N past the last tile, K padded to 64 (200), groups of 64 and one group."""
    from quant_serve.kernels.matmul.int8.mma import w4a8_forward
    fw, x, raw = _case(k, n, group_size, zeros, m)
    bias = torch.randn(n, dtype=torch.float16, device=DEV)
    ag = k if group_size <= 0 else group_size
    ref = _twin(x, raw, ag)
    for cfg in (dict(), dict(block_m=16, split_k=3), dict(block_m=64, block_n=64, num_warps=4),
                dict(block_m=32, block_n=256, num_warps=8, split_k=2), dict(warps_m=2), dict(block_m=64, warps_m=2)):
        y = w4a8_forward(x, fw, None, "group", **cfg)
        assert y.shape == (m, n) and rel_err(y, ref) < 1e-3, (cfg, rel_err(y, ref))
    ref_bias = _twin(x, raw, ag, bias)
    assert rel_err(w4a8_forward(x, fw, bias, "group"), ref_bias) < 1e-3
    assert rel_err(w4a8_forward(x, fw, bias, "group", split_k=2), ref_bias) < 1e-3
    assert rel_err(w4a8_forward(x, fw, None, "token"), _twin(x, raw, k)) < 1e-3


@pytest.mark.gpu
def test_gpu_dispatcher_runs_the_int8_plan_and_its_probe():
    from quant_serve.kernels.gpu import configure, runtime_for
    from quant_serve.kernels.matmul.dispatch import call_plan, w4a16_forward
    from quant_serve.kernels.matmul.probes import w4a8_works
    dev = torch.device(DEV)
    assert w4a8_works(dev)
    before = runtime_for(dev).options
    try:
        configure(dev, dataclasses.replace(before, activation_dtype="int8"))
        fw, x, raw = _case(512, 256, 128, True, 96)
        assert call_plan(x, fw).kernel == "w4a8"
        assert rel_err(w4a16_forward(x, fw), _twin(x, raw, 128)) < 1e-3
        y = w4a16_forward(x, fw, silu_mul=True)                # gate | up: SwiGLU after the int8 matmul
        assert y.shape == (96, 128)
    finally:
        configure(dev, before)


def compile_cases() -> dict:
    """The W4A8 kernel's plan tiles compiled for sm86, sm89 and sm90 (run in a fresh process)."""
    import re
    from kernel_helpers import cubin_sass
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from quant_serve.kernels.matmul.int8.mma import _w4a8_mma_kernel
    sig = dict(xq_ptr="*i8", sx_ptr="*fp32", w_ptr="*i32", s_ptr="*fp16", z_ptr="*i32", out_ptr="*fp16",
               ws_ptr="*fp32", bias_ptr="*fp16", **{a: "i32" for a in (
                   "M", "N", "KP", "stride_xm", "stride_sxm", "stride_om", "stride_sg", "stride_zg",
                   "iters_per_split")})
    out = {}
    for arch in (86, 89, 90):
        for bm, split, token, wm in ((128, False, False, 1), (128, False, True, 1), (16, True, False, 1),
                                     (128, False, False, 2)):
            cx = dict(HAS_BIAS=False, SPLIT=split, GROUP=128, ZP_MODE=ZP_INT4, ACT_TOKEN=token, EVEN_N=True,
                      BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, num_warps=8, WARPS_M=wm)
            names = list(sig) + list(cx)
            attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in sig
                     if a not in ("M", "iters_per_split", "stride_sxm")}
            src = GluonASTSource(fn=_w4a8_mma_kernel, signature=dict(sig, **{c: "constexpr" for c in cx}),
                                 constexprs=cx, attrs=attrs)
            regs, stack, sass = cubin_sass(triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                                          options={"num_warps": 8}))
            body = [x for x in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            out[f"{arch}-{bm}-{token}-{wm}"] = {"regs": regs, "stack": stack, "ldsm": sum("LDSM" in x for x in body),
                                           "imma": sum("IMMA.16832.S8.S8" in x for x in body),
                                           "hmma": sum("HMMA" in x for x in body),
                                           "i2f": sum(" I2F" in x for x in body)}
    return out


def test_w4a8_kernel_compiles_to_integer_mmas_without_spills():
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a8", "compile_cases")
    for name, r in res.items():
        # 128 x 128 tiles, 8 warps: 64 m16n8k32 a warp and step, three steps unrolled; int32 -> fp32 by adding bits
        assert r["stack"] == 0 and r["hmma"] == 0 and r["i2f"] == 0, (name, r)
        assert r["imma"] == (192 if name.split("-")[1] == "128" else 24), (name, r)
    # warps also along the x rows: each reads half the x tile (ldmatrix), the A tile is broadcast to both
    for arch in (86, 89, 90):
        assert res[f"{arch}-128-False-2"]["ldsm"] * 2 == res[f"{arch}-128-False-1"]["ldsm"], res
