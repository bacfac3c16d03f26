"""GGUF Q5_K at 5 bits in the W8A16 kernels (kernels/matmul/planes/q5k.py: 4-bit + 1-bit code planes, Q4_K's int16
sub-codes and int32 d | dmin): the GEMV (FMA rows and tl.dot rows) and the dequantize pass under TRITON_INTERPRET=1
on CPU (compiled on a GPU), against gguf.quants.dequantize (bit-exact dequant) and a torch matmul over it."""
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before any kernel module is imported (decoration time)

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from helpers import bench_script  # noqa: E402
from quant_serve.kernels.triton_compat import interpreting  # noqa: E402
from quant_serve.kernels.matmul.dispatch import w8a16_forward, w8a16_matmul  # noqa: E402
from quant_serve.kernels.matmul.planes.kernels import w8a16_dequantize  # noqa: E402
from quant_serve.kernels.matmul.plan import W8A16Config  # noqa: E402
from quant_serve.kernels.matmul.planes.q5k import pack_q5k, q5k_bytes, q5k_codes, q5k_dequantize  # noqa: E402
from quant_serve.quant.formats.gguf.kquants import quantize  # noqa: E402
from quant_serve.quant.formats.gguf.types import q5k_layout, read_grouped  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def q5_k_layer(k, n, seed=0):
    """A random Q5_K matrix (our quantizer) -> (gguf's dequantized W [K, N] fp32, Q5KWeights on DEV)."""
    w = np.random.default_rng(seed).normal(0.003, 0.02, (n, k)).astype(np.float32)
    raw = quantize(w, T.Q5_K)
    dense = torch.from_numpy(dequantize(raw, T.Q5_K).reshape(n, k)).t().contiguous()
    return dense, q5k_layout(read_grouped(raw, T.Q5_K, n, k)).to(DEV)


def rel_err(y, ref):
    return ((y.cpu().float() - ref).norm() / ref.norm()).item()


def test_planes_round_trip_and_twin_is_gguf():
    dense, w = q5_k_layer(512, 24)
    g = read_grouped(quantize(np.random.default_rng(1).normal(0, 1, (24, 512)).astype(np.float32), T.Q5_K),
                     T.Q5_K, 24, 512)
    assert torch.equal(q5k_codes(pack_q5k(g.codes.t(), g.sub_codes.t(), g.superscales.t())), g.codes.t())
    assert g.codes.max() == 31 and (g.codes >= 16).any()                     # the high plane is exercised
    assert torch.equal(q5k_dequantize(w.to("cpu")), dense)
    held = w.planes.numel() + w.sub_codes.numel() * 2 + w.superscales.numel() * 4
    assert held == q5k_bytes(512, 24) and held * 8 == 512 * 24 * 5.625
    with pytest.raises(ValueError, match="0..31"):
        pack_q5k(torch.full((256, 8), 32), w.sub_codes[:8, :8].cpu(), w.superscales[:1, :8].cpu())


@pytest.mark.parametrize("k,n,block_n", [(512, 72, 32), (768, 40, 64)])
def test_dequantize_pass_is_bit_exact_vs_gguf(k, n, block_n):
    dense, w = q5_k_layer(k, n, seed=k)
    got = w8a16_dequantize(w, None, None, 32, torch.float32, block_n=block_n).cpu()
    if interpreting():
        assert torch.equal(got, dense)
    else:
        assert torch.allclose(got, dense, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("m,dtype,block_m,split_k", [(1, torch.float16, 1, 1), (1, torch.bfloat16, 1, 4),
                                                     (5, torch.float16, 16, 2)])
def test_gemv_matches_gguf_matmul(m, dtype, block_m, split_k):
    k, n = 768, 100
    dense, w = q5_k_layer(k, n, seed=m)
    x = torch.randn(m, k, dtype=dtype, device=DEV)
    bias = torch.randn(n, dtype=dtype, device=DEV)
    y = w8a16_forward(x, w, None, None, 32, bias, W8A16Config("gemv", block_m, 32, 64, split_k))
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    assert y.shape == (m, n) and rel_err(y, x.cpu().float() @ dense + bias.cpu().float()) < tol
    ref = x.cpu().float() @ dense
    assert rel_err(w8a16_forward(x, w, None, None, 32, None, W8A16Config("dequant")), ref) < tol
    assert rel_err(w8a16_matmul(x.cpu(), w.to("cpu"), None, None, 32), ref) < tol          # the CPU twin
    with pytest.raises(ValueError, match="block_k must be 64"):
        w8a16_forward(x, w, None, None, 32, None, W8A16Config("gemv", block_m, 32, 128, split_k))


def compile_q5_kernels_sm90() -> dict:
    """The W8A16 GEMV with Q5_K planes (FMA rows and tl.dot rows) and its dequantize pass compiled for sm90 without a
    GPU (the interpreter does not lower them) -> registers and spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quant_serve.kernels.matmul.planes.kernels import _w8a16_dequant_kernel, _w8a16_gemv_kernel
    from kernel_helpers import cubin_sass
    from kernel_helpers import constexpr_defaults

    def build(kernel, sig, constexprs):
        constexprs = dict(constexpr_defaults(kernel), **constexprs)
        full = dict(sig, **{k: "constexpr" for k in constexprs})
        names = list(full)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr") or a == "N"}
        regs, stack, _ = cubin_sass(triton.compile(ASTSource(fn=kernel, signature=full, constexprs=constexprs,
                                                             attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                                   options={"num_warps": 4}))
        return {"regs": regs, "stack": stack}

    i32 = "i32"
    w8 = dict(x_ptr="*fp16", q_ptr="*u8", s_ptr="*i16", o_ptr="*i32", out_ptr="*fp16", ws_ptr="*fp32",
              cnt_ptr="*i32", bias_ptr="*fp16", M=i32, N=i32, K=i32, stride_xm=i32, stride_om=i32, stride_qk=i32,
              stride_sg=i32, steps_per_split=i32, n_splits=i32)
    out = {f"q5-gemv-{bm}": build(_w8a16_gemv_kernel, w8, dict(
        HAS_OFFSETS=False, HAS_BIAS=False, SPLIT=True, ONE_LAUNCH=False, GROUP=32, BLOCK_M=bm, BLOCK_N=64,
        BLOCK_K=64, Q5=True)) for bm in (1, 16)}
    out["q5-dequant"] = build(_w8a16_dequant_kernel, dict(q_ptr="*u8", s_ptr="*i16", o_ptr="*i32", out_ptr="*fp16",
                                                         N=i32, K=i32, stride_qk=i32, stride_sg=i32, stride_ok=i32),
                              dict(HAS_OFFSETS=False, GROUP=32, BLOCK_N=64, BLOCK_K=64, Q5=True))
    return out


def test_q5_kernels_compile_for_sm90_without_spills():
    from kernel_helpers import compiled_in_fresh_process
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w8a16_q5k", "compile_q5_kernels_sm90")
    assert all(r["stack"] == 0 for r in res.values()), res
    print({name: r["regs"] for name, r in res.items()})


def test_bench_format_gguf_q5_k():
    """bench/kernel_speed.py --weights gguf-q5_k: the layer it times is the loader's layout, its call the planned
    kernel (checked here under the interpreter), its bytes 5.625 bits a weight."""
    gguf_kernel_speed = bench_script("gguf_kernel_speed")
    FORMATS, random_layer = gguf_kernel_speed.FORMATS, gguf_kernel_speed.random_layer
    layer = random_layer("gguf-q5_k", 512, 64, device=DEV)
    x = torch.randn(1, 512, dtype=torch.float16, device=DEV)
    want = x.float() @ layer["dense"].float()
    got = layer["call"](x, W8A16Config("gemv", 1, 32, 64, 2)).float()
    assert FORMATS["gguf-q5_k"][:2] == (5, 32) and layer["nbytes"] * 8 == 512 * 64 * 5.625
    assert ((got - want).norm() / want.norm()).item() < 2e-3


@pytest.mark.parametrize("m", [1, 3])
def test_planned_q5k_gemv_matches_gguf(m):
    """The forward with no config runs the plan's tile (kernels/matmul/plan.py: one row a program over 128 columns at
    M = 1, tl.dot rows above, K split in one launch) correctly."""
    k, n = 1024, 160
    dense, w = q5_k_layer(k, n, seed=11)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    assert rel_err(w8a16_forward(x, w, None, None, 32, None), x.cpu().float() @ dense) < 2e-3
