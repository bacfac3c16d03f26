"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on the GPU a decode-like chain of
PDL kernels replayed from a CUDA graph gives the bits of the same chain launched plainly."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from quant_serve.kernels.gpu import PROFILES, KernelOptions, KernelRuntime, configure, runtime_for
from quant_serve.kernels.pdl import launch_options, pdl_enabled
from kernel_helpers import make_weights

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_pdl_is_on_only_for_cuda_sm90_outside_the_interpreter(monkeypatch):
    import quant_serve.kernels.pdl as pdl
    assert not pdl_enabled(torch.zeros(1))                             # CPU tensors: never
    cuda_like = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    runtime = {"now": KernelRuntime(PROFILES["h200"])}
    monkeypatch.setattr(pdl, "runtime_for", lambda device: runtime["now"])
    monkeypatch.setattr(pdl, "_triton_launches_pdl", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl_enabled(cuda_like)
    runtime["now"] = KernelRuntime(PROFILES["h200"], KernelOptions(pdl=False))
    assert not pdl_enabled(cuda_like)                                  # KernelOptions.pdl = False
    for card in ("a10", "4090", "a100"):                               # no PDL below sm90: the cards' profiles
        runtime["now"] = KernelRuntime(PROFILES[card])
        assert not pdl_enabled(cuda_like), card
    runtime["now"] = KernelRuntime(PROFILES["h200"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(cuda_like)                                  # the interpreter has no griddepcontrol
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "_triton_launches_pdl", lambda: False)   # a Triton without the launch option
    assert not pdl_enabled(cuda_like)
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}


def _decode_chain(x, layers, norm_w):
    """rms_norm -> qkv-like matmul (one-launch split-K) -> norm -> gate_up + SwiGLU (the reduce pass, or the
    SwiGLU kernel in layer 0, as wide layers at M = 1 run it) -> down, per layer: the kernel kinds of a decode step,
    each reading the previous one's output."""
    from quant_serve.kernels.norm_act import rms_norm, silu_and_mul
    from quant_serve.kernels.matmul.dispatch import w4a16_matmul
    residual = x
    h = x
    for i, (qkv, o, gate_up, down) in enumerate(layers):
        h, residual = rms_norm(h, norm_w, 1e-6, residual)
        h = w4a16_matmul(w4a16_matmul(h, qkv)[:, :h.shape[1]].contiguous(), o)
        h, residual = rms_norm(h, norm_w, 1e-6, residual)
        mid = silu_and_mul(w4a16_matmul(h, gate_up)) if i == 0 else w4a16_matmul(h, gate_up, silu_mul=True)
        h = w4a16_matmul(mid, down)
    return h + residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm90 (runs on the GPU machine)")
@pytest.mark.parametrize("m", [1, 16, 48])
def test_gpu_pdl_chain_in_a_cuda_graph_matches_plain_launches(m):
    from quant_serve.kernels.matmul.dispatch import prepare_kernel_weights
    torch.manual_seed(0)
    hidden, inter = 1024, 2816

    def linear(k, n):
        qweight, scales, qzeros, gs, _ = make_weights(k, n, 128, True, False, torch.float16)
        return prepare_kernel_weights(qweight, scales, qzeros, gs)
    layers = [(linear(hidden, 3 * hidden), linear(hidden, hidden), linear(hidden, 2 * inter), linear(inter, hidden))
              for _ in range(3)]
    norm_w = torch.rand(hidden, dtype=torch.float16, device=DEV) + 0.5
    x = torch.randn(m, hidden, dtype=torch.float16, device=DEV)
    if not runtime_for(x.device).pdl:
        pytest.skip(f"the {runtime_for(x.device).caps.profile} GPU profile has no PDL")
    options = runtime_for(x.device).options
    configure(x.device, dataclasses.replace(options, pdl=False))
    try:
        plain = _decode_chain(x, layers, norm_w)
        plain_flipped = _decode_chain(x.flip(0), layers, norm_w)
    finally:
        configure(x.device, options)
    assert pdl_enabled(x)
    assert torch.equal(_decode_chain(x, layers, norm_w), plain)          # eager PDL launches
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _decode_chain(static_x, layers, norm_w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(static_x, layers, norm_w)
    for i in range(20):
        static_x.copy_(x if i % 2 == 0 else x.flip(0))
        graph.replay()
        assert torch.equal(out, plain if i % 2 == 0 else plain_flipped), i
