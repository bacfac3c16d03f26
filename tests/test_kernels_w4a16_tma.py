"""The TMA-fed Hopper W4A16 kernel (kernels/w4a16_tma.py): its dispatch rule (CPU), its sm90 compile (CPU, the
wheel's ptxas) and, on the GPU machine, its results against the exact dequantized reference."""
import pytest
import torch

from kernels.w4a16_tuning import TMAConfig, select_tma_config
from tests.test_kernels_w4a16 import make_weights, reference, rel_err
from tests.test_kernels_w4a16_mma import compiled_in_fresh_process, frag_case

DEV = "cuda"
QWEN = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}


def test_tma_rule_pins_the_sweep_winners():
    """bench/results/exp-tma-h200.json: mma.sync to M = 32, dequantize + cuBLAS from M = 2048 and for qkv at M = 1024
    (a grid of 144 two-warpgroup programs fills its second wave to 9%), one consumer with 64 weight rows to
    M = 128 and on narrow layers at 256, two consumers x 256 rows on wide or long-K layers; K splits up to one
    wave of resident programs."""
    one, two = (lambda bm, s: TMAConfig(1, 64, bm, s)), (lambda s: TMAConfig(2, 128, 256, s))
    want = {32: dict(qkv=None, o=None, gate_up=None, down=None),
            64: dict(qkv=one(64, 2), o=one(64, 4), gate_up=one(64, 1), down=one(64, 4)),
            128: dict(qkv=one(128, 2), o=one(128, 4), gate_up=one(128, 1), down=one(128, 4)),
            256: dict(qkv=one(128, 1), o=one(128, 2), gate_up=two(1), down=two(4)),
            1024: dict(qkv=None, o=two(1), gate_up=two(1), down=two(1)),
            4096: dict(qkv=None, o=None, gate_up=None, down=None)}
    for m, shapes in want.items():
        for name, cfg in shapes.items():
            assert select_tma_config(m, *QWEN[name]) == cfg, (m, name)
    # a split always leaves each program at least 8 steps of 64 rows
    assert select_tma_config(64, 2048, 256).split_k == 4 and select_tma_config(64, 512, 256).split_k == 1


def test_frag_dispatch_takes_the_tma_tile_where_the_rule_and_probe_allow(monkeypatch):
    """kernels/w4a16.frag_config (what the forward runs and kernels.py records): the TMA tile where the rule has
    one and the probe passed; the wgmma / mma.sync tile where the probe failed, x does not suit TMA or
    QUANT_SERVE_W4A16_TMA=0; dequantize + cuBLAS (None) where neither has a tile."""
    import kernels.w4a16 as w4
    from kernels.w4a16_tuning import MMAConfig
    monkeypatch.setattr(w4, "device_sms", lambda device: 132)
    monkeypatch.setattr(w4, "wgmma_works", lambda index: True)
    probe = {"ok": True}
    monkeypatch.setattr(w4, "tma_works", lambda index: probe["ok"])
    dev = torch.device("cuda", 0)
    assert w4.frag_config(64, *QWEN["gate_up"], dev) == TMAConfig(1, 64, 64, 1)
    assert w4.frag_config(256, *QWEN["down"], dev) == TMAConfig(2, 128, 256, 4)
    assert isinstance(w4.frag_config(16, *QWEN["gate_up"], dev), MMAConfig)
    assert w4.frag_config(4096, *QWEN["gate_up"], dev) is None
    assert w4.frag_config(1024, *QWEN["qkv"], dev) is None
    wgmma = w4.frag_config(64, *QWEN["gate_up"], dev, tma_fits=False)
    assert isinstance(wgmma, MMAConfig) and wgmma.wgmma
    probe["ok"] = False
    assert w4.frag_config(64, *QWEN["gate_up"], dev) == wgmma
    probe["ok"] = True
    monkeypatch.setattr(w4, "_TMA_ON", False)
    assert w4.frag_config(64, *QWEN["gate_up"], dev) == wgmma


def test_tma_probe_failure_falls_back_with_a_warning(caplog):
    """The TMA kernel serves only where its load probe passes (an sm90 GPU); a failed probe says what serves
    instead."""
    from kernels.w4a16 import tma_works
    if torch.cuda.is_available():
        assert tma_works(torch.cuda.current_device()) == (torch.cuda.get_device_capability() == (9, 0))
        return
    with caplog.at_level("WARNING", logger="quant_serve"):
        assert tma_works.__wrapped__(0) is False
    assert "TMA kernel unavailable" in caplog.text and "wgmma kernel up to 128 rows" in caplog.text


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="TMA with wgmma needs an sm90 GPU")


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,n,group_size,zeros", [(512, 256, 128, True), (384, 192, 64, False),
                                                  (320, 272, 32, True), (1000, 80, -1, True),
                                                  (1088, 512, 64, True), (3584, 1024, 128, True)])
@pytest.mark.parametrize("m", [17, 64, 100, 256, 300])
def test_gpu_tma_matches_twin(k, n, group_size, zeros, m):
    """Both consumer counts, 64-256 weight rows, x tiles past M, N past the tile (272, 80), K padded to 64 (1000),
    odd step counts in a split (1088 = 17 steps in 3 splits)."""
    from kernels.w4a16_tma import w4a16_tma
    fw, x, bias, ref = frag_case(k, n, group_size, zeros, m)
    for cfg in (dict(consumers=1, block_n=64), dict(consumers=1, block_n=128, split_k=3),
                dict(consumers=2, block_n=128, block_m=64, split_k=2), dict(consumers=2, block_n=256, block_m=128),
                dict(consumers=2, block_n=128, stages=6, split_k=5)):
        if cfg.get("block_m", 0) > 128 * cfg["consumers"]:
            continue
        assert rel_err(w4a16_tma(x, fw, bias, **cfg), ref) < 2e-3, cfg


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
def test_gpu_tma_silu_mul_and_dispatch(monkeypatch):
    """The SwiGLU after the kernel or in its split-K reduce pass; w4a16_forward takes the TMA kernel where the rule
    has a tile (a spy counts its calls) and gives the same result."""
    import kernels.w4a16_tma as tma_module
    from kernels.norm_act import silu_and_mul
    from kernels.w4a16 import w4a16_forward
    from kernels.w4a16_frag import prepare_frag
    from kernels.w4a16_tma import w4a16_tma
    qweight, scales, qzeros, gs, _ = make_weights(1024, 512, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    for m in (40, 200, 700):
        x = torch.randn(m, 1024, dtype=torch.float16, device=DEV)
        ref = reference(x, qweight, scales, qzeros, gs, None, None)
        want = silu_and_mul(ref.to(torch.float16).to(DEV)).float().cpu()
        for split in (1, 4):
            assert rel_err(w4a16_tma(x, fw, split_k=split, consumers=1, silu_mul=True), want) < 5e-3
        calls = []
        monkeypatch.setattr(tma_module, "w4a16_tma", lambda *a, **kw: calls.append(kw) or w4a16_tma(*a, **kw))
        assert rel_err(w4a16_forward(x, fw), ref) < 2e-3
        assert rel_err(w4a16_forward(x, fw, silu_mul=True), want) < 5e-3
        assert len(calls) == 2 and calls[1]["silu_mul"], m
        monkeypatch.undo()


def compile_tma_cases() -> dict:
    """The dispatcher's TMA tiles compiled for sm90 (a fresh process: see the caller) -> registers, spills, SASS."""
    from triton.experimental.gluon import language as gl

    from kernels.w4a16_tma import _w4a16_tma_kernel, register_budget
    from tests.test_kernels_w4a16_mma import _compile_sm90
    out = {}
    for cons, bn, bm, split in [(1, 64, 64, True), (1, 64, 128, False), (2, 128, 256, False), (2, 128, 256, True)]:
        consumer_regs, producer_regs, maxnreg = register_budget(cons)
        wl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        xl = gl.NVMMASharedLayout.get_default_for([bm, 64], gl.float16)
        sig = dict(w_desc=f"tensordesc<i32[{bn // 16}, 128],{wl!r}>", x_desc=f"tensordesc<fp16[{bm}, 64],{xl!r}>",
                   s_ptr="*fp16", z_ptr="*i32", out_ptr="*fp16", ws_ptr="*fp32", bias_ptr="*fp16",
                   **{a: "i32" for a in ("M", "N", "KP", "stride_om", "stride_sg", "stride_zg",
                                         "iters_per_split")})
        out[f"c{cons}-{bn}-{bm}-{split}"] = _compile_sm90(_w4a16_tma_kernel, sig, dict(
            HAS_BIAS=not split, SPLIT=split, GROUP=128, HAS_ZEROS=True, EVEN_N=True, PDL=True, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=64, STAGES=4, CONSUMERS=cons, CONSUMER_REGS=consumer_regs,
            PRODUCER_REGS=producer_regs), 4, maxnreg)
    return out


def test_tma_kernel_compiles_for_sm90_without_spills():
    """Partitions with their own register budgets (setmaxnreg), wgmma with A from registers, 16-byte output stores
    (the epilogue through shared memory), no spills at the 128 registers that let two one-consumer programs share
    an SM: checked on any machine with the wheel's ptxas."""
    res = compiled_in_fresh_process("tests.test_kernels_w4a16_tma", "compile_tma_cases")
    for name, r in res.items():
        assert r["hgmma"] and r["setmaxnreg"] and r["stack"] == 0 and not r["ldsm"], (name, r)
        assert r["stg128"] or name.endswith("True"), (name, r)
        assert r["regs"] <= (128 if name.startswith("c1") else 168), (name, r)
