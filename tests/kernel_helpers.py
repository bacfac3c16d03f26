"""Helpers of the kernel tests (random INT4 / K-quant layers, their references, and what a compiled kernel holds),
shared by several test modules."""
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from quant_serve.kernels.matmul.frag.layout import prepare_frag
from quant_serve.kernels.matmul.reference import pack_int4_cols, pack_int4_rows, w4a16_matmul_ref
from quant_serve.kernels.matmul.planes.q6k import pack_q6k
from quant_serve.quant.formats.gguf.kquants import quantize
from quant_serve.quant.formats.gguf.types import kquant_layout, read_grouped

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_weights(k, n, group_size, zeros, act_order, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size <= 0 else group_size
    groups = -(-k // gs)
    qweight = pack_int4_rows(torch.randint(0, 16, (k, n), generator=g))
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).to(dtype)
    qzeros = None
    if zeros:
        z = torch.randint(0, 16, (groups, -(-n // 8) * 8), generator=g)
        qzeros = pack_int4_cols(z)
    perm = torch.randperm(k, generator=g) if act_order else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(qweight), to(scales), to(qzeros), group_size, to(perm)


def reference(x, qweight, scales, qzeros, group_size, perm, bias):
    """fp32 result of the twin's formula."""
    return w4a16_matmul_ref(x.cpu().float(), qweight.cpu(), scales.cpu(), None if qzeros is None else qzeros.cpu(),
                            group_size, None if perm is None else perm.cpu(),
                            None if bias is None else bias.cpu())


def rel_err(y, ref):
    return ((y.cpu().float() - ref).norm() / ref.norm()).item()


def cubin_sass(compiled) -> tuple[int, int, str]:
    """A kernel compiled by triton.compile -> (registers, spill stack bytes, SASS text), by the wheel's cuobjdump."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    return regs, stack, sass


def compiled_in_fresh_process(module: str, function: str) -> dict:
    """module.function() (compiles kernels for sm90, returns a JSON-able dict) run in a fresh Python without the
    interpreter: the CPU tests' interpreter mode patches Triton's builder in this one."""
    import json
    import os
    import subprocess
    import sys
    code = f"import json; from {module} import {function}; print(json.dumps({function}()))"
    tests = os.path.dirname(os.path.abspath(__file__))            # the test modules import kernel_helpers
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path),
                         cwd=os.path.dirname(tests), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int, maxnreg: int | None = None):
    """Compile a Gluon kernel for sm90 without a GPU (the wheel's ptxas) -> registers, spill bytes and what its SASS
    holds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    import inspect
    fn = getattr(kernel, "fn", kernel)
    defaults = {name: p.default for name, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty and name not in constexprs}
    constexprs = dict(defaults, **constexprs)         # Triton 3.9 does not fill a constexpr's default here
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    # pointers and sizes divisible by 16, as Triton specializes them at launch for the Qwen2.5-7B shapes
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in signature
               if a not in ("M", "iters_per_split", "n_splits", "eps", "ss_count", "vs_val", "m_tiles", "waves", "tail",
                            "p_sk", "max_segs")}
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
    regs, stack, sass = cubin_sass(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options))
    return {"regs": regs, "stack": stack, "hmma": "HMMA.16816.F32" in sass, "ldsm": "LDSM" in sass,
            "hgmma": "HGMMA.64x" in sass,
            "stg128": "STG.E.128" in sass, "stsm": "STSM" in sass, "setmaxnreg": "USETMAXREG" in sass,
            "l2_prefetch": "CCTL.E.PF2" in sass,
            "wide_loads_before_wait": sass.split("ACQBULK")[0].count("LDG.E.128") if "ACQBULK" in sass else -1,
            "loads_ahead_in_loop": loads_ahead_in_loop(sass), "loop_hmma_bar": loop_hmma_bar(sass)}


def mma_signature(s_ptr: str = "*fp16", z_ptr: str = "*i32") -> dict:
    """_w4a16_mma_kernel's runtime arguments and their types, for compile_sm90 (scales and zero points by mode:
    fp16 / int32 packed zeros, int16 / int32 k-quant codes, fp16 / fp16 offsets, fp16 / int32 Q6_K high bits)."""
    ptrs = dict(x_ptr="*fp16", w_ptr="*i32", s_ptr=s_ptr, z_ptr=z_ptr, out_ptr="*fp16", ws_ptr="*fp32",
                cnt_ptr="*i32", bias_ptr="*fp16", r_ptr="*fp16", ss_ptr="*fp32", g_ptr="*fp16", eps="fp32",
                ss_count="i32", ml_ptr="*fp32", sl_ptr="*i32", vs_ptr="*fp32", vs_val="fp32")
    return dict(ptrs, **{a: "i32" for a in ("M", "N", "K", "KP", "stride_xm", "stride_om", "stride_sg", "stride_zg",
                                            "iters_per_split", "n_splits")})


def frag_case(k: int, n: int, group_size: int, zeros: bool, m: int):
    """A random fp16 INT4 layer in the fragment layout, x [m, k] and bias on the GPU, and the exact reference of
    x @ W + bias -> (fw, x, bias, ref)."""
    qweight, scales, qzeros, gs, _ = make_weights(k, n, group_size, zeros, False, torch.float16)
    x = torch.randn(m, k, dtype=torch.float16, device=DEV)
    bias = torch.randn(n, dtype=torch.float16, device=DEV)
    return prepare_frag(qweight, scales, qzeros, gs), x, bias, reference(x, qweight, scales, qzeros, gs, None, bias)


def loads_ahead_in_loop(sass: str) -> int:
    """16-byte loads between the first MMA's loop head (the last branch before it) and that MMA: the next step's
    weight words issued before the step's MMAs."""
    import re
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    first = next((i for i, line in enumerate(lines) if "HMMA" in line), None)
    if first is None:
        return -1
    head = max((i for i in range(first) if " BRA " in lines[i]), default=0)
    return sum("LDG.E.128" in line for line in lines[head:first])


def loop_hmma_bar(sass: str) -> tuple[int, int]:
    """(MMAs, CTA barriers) in the loop (the backward branch's body) that holds the most MMAs."""
    import re
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16) for line in lines]
    best = (0, 0)
    for i, line in enumerate(lines):
        jump = re.search(r" BRA (0x[0-9a-f]+)", line)
        if jump and int(jump.group(1), 16) < addr[i]:
            body = [x for x, a in zip(lines, addr) if int(jump.group(1), 16) <= a <= addr[i]]
            best = max(best, (sum("HMMA" in x for x in body), sum("BAR.SYNC" in x for x in body)))
    return best


def q4_k_layer(k, n, seed=0):
    """A random Q4_K matrix [N, K] -> (its GGUF bytes, gguf's dequantized W [K, N] fp32, qweight, sub_codes,
    superscales on DEV)."""
    w = np.random.default_rng(seed).normal(0, 0.02, (n, k)).astype(np.float32)
    raw = quantize(w, T.Q4_K)
    dense = torch.from_numpy(dequantize(raw, T.Q4_K).reshape(n, k)).t().contiguous()
    qweight, sub, sup = kquant_layout(read_grouped(raw, T.Q4_K, n, k))
    return raw, dense, qweight.to(DEV), sub.to(DEV), sup.to(DEV)


def q6k_layer(k: int, n: int, device: str = "cpu", seed: int = 0):
    """Random Q6_K weights as a file holds them (codes -32..31, int8 sub-scales, fp16 d) -> Q6KWeights."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (k, n), generator=gen)
    sub = torch.randint(-60, 61, (k // 16, n), generator=gen).to(torch.int8)
    d = (torch.rand(-(-k // 256), n, generator=gen) * 1e-3 + 1e-4).half()
    return pack_q6k(codes, sub, d).to(device) if device != "cpu" else pack_q6k(codes, sub, d)


def constexpr_defaults(kernel) -> dict:
    """A Triton kernel's constexpr parameters that have defaults -> {name: default}."""
    import inspect
    return {name: p.default for name, p in inspect.signature(kernel.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}
