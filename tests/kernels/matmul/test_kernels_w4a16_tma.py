"""The TMA-fed Hopper W4A16 kernel (kernels/matmul/frag/tma.py): its dispatch rule (CPU), its sm90 compile (CPU, the
wheel's ptxas) and, on the GPU machine, its results against the exact dequantized reference."""
import pytest
import torch

from quant_serve.kernels.matmul.rules import MMAConfig, TMAConfig, select_tma_config
from kernel_helpers import make_weights, reference, rel_err
from kernel_helpers import compiled_in_fresh_process, frag_case

DEV = "cuda"
QWEN = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}


def test_tma_rule_pins_the_sweep_winners():
    """bench/results/exp-tma-sk-h200.json, exp-tma-reduce-h200.json, exp-tma-bk2-h200.json: mma.sync to M = 16,
    dequantize + cuBLAS above 4096; one consumer x 32 / 64 x rows to M = 64 (64 weight rows on o, 128 elsewhere,
    those with the overlap; down in steps of 128 K rows: 128 x 32, then 64 x 64 with the overlap); qkv from 65 to 256
    rows one x 64 x 128 in 128-row steps, two stages; two x 256 weight rows on gate_up at 128; one x 64 x 128 rows
    (overlap) on narrow short-K layers to 512; else two consumers x 128 x 256. The tail: equal K ranges where they
    fill 84% of a wave, else stream-K."""
    from quant_serve.kernels.matmul.streamk import stream_k_plan
    two = TMAConfig(2, 128, 256)

    def one(bn, bm):
        return TMAConfig(1, bn, bm, overlap=bn == 128 or bm == 128)
    down32 = TMAConfig(1, 128, 32, block_k=128)
    down64 = TMAConfig(1, 64, 64, overlap=True, block_k=128)
    qkv_k128 = TMAConfig(1, 64, 128, block_k=128, stages=2)
    want = {16: dict(qkv=None, o=None, gate_up=None, down=None),
            17: dict(qkv=one(128, 32), o=one(64, 32), gate_up=one(128, 32), down=down32),
            32: dict(qkv=one(128, 32), o=one(64, 32), gate_up=one(128, 32), down=down32),
            33: dict(qkv=one(128, 64), o=one(64, 64), gate_up=one(128, 64), down=down64),
            64: dict(qkv=one(128, 64), o=one(64, 64), gate_up=one(128, 64), down=down64),
            65: dict(qkv=qkv_k128, o=one(64, 128), gate_up=TMAConfig(2, 256, 128), down=one(64, 128)),
            128: dict(qkv=qkv_k128, o=one(64, 128), gate_up=TMAConfig(2, 256, 128), down=one(64, 128)),
            256: dict(qkv=qkv_k128, o=one(64, 128), gate_up=two, down=two),
            257: dict(qkv=one(64, 128), o=one(64, 128), gate_up=two, down=two),
            1024: dict(qkv=two, o=two, gate_up=two, down=two),
            4096: dict(qkv=two, o=two, gate_up=two, down=two),
            4097: dict(qkv=None, o=None, gate_up=None, down=None)}
    assert not one(64, 64).overlap and one(128, 64).overlap and one(64, 128).overlap
    for m, shapes in want.items():
        for name, cfg in shapes.items():
            assert select_tma_config(m, *QWEN[name]) == cfg, (m, name)
    # (tiles, steps, slots) -> stream-K programs: o at 64 (56 tiles cut in 4), gate_up at 64 (a wave + 32 in 7),
    # qkv at 128 (72 tiles: 3 a tile fills 82%, so stream-K), down at 4096 (3 waves + 52: 2 a tile fills 79%)
    assert stream_k_plan(56, 56, 264).sk_programs == 224
    assert stream_k_plan(296, 56, 264) == stream_k_plan(296, 56, 264, 224)
    assert stream_k_plan(296, 56, 264).waves == 1 and stream_k_plan(296, 56, 264).sk_programs == 224
    assert stream_k_plan(72, 56, 264).sk_programs == 264 and stream_k_plan(72, 56, 264).max_segs == 5
    assert stream_k_plan(56, 56, 264).max_segs == 4        # aligned: the workspace holds 4 partials a tile
    assert stream_k_plan(448, 296, 132).sk_programs == 132 and stream_k_plan(448, 296, 132).waves == 3


def _sk_work(plan, steps):
    """The kernel's work list per program (kernels/matmul/frag/tma.py: _sk_span, _sk_owner, the consumer's loops), in
    its closed forms: program -> [(tile, k0, k1, segment, segments, tail index)]."""
    work = {p: [(p + j * plan.programs, 0, steps, 0, 1, 0) for j in range(plan.waves)] for p in range(plan.programs)}
    if not plan.tail:
        return work
    units = plan.tail * steps
    base, extra = divmod(units, plan.sk_programs)
    big = extra * (base + 1)
    owner = lambda u: u // (base + 1) if u < big else extra + (u - big) // base  # noqa: E731
    for p in range(plan.sk_programs):
        u0 = p * base + min(p, extra)
        u1 = u0 + base + (p < extra)
        for t in range(u0 // steps, (u1 + steps - 1) // steps):
            first = owner(t * steps)
            work[p].append((plan.waves * plan.programs + t, max(u0, t * steps) - t * steps,
                            min(u1, t * steps + steps) - t * steps, p - first, owner(t * steps + steps - 1) - first + 1,
                            t))
    return work


@pytest.mark.parametrize("tiles,steps,slots,sk", [(148, 56, 132, 0), (36, 56, 132, 0), (72, 56, 264, 0),
                                                  (1184, 56, 132, 0), (264, 56, 264, 0), (3, 5, 264, 0),
                                                  (148, 56, 132, 16), (148, 56, 132, 5), (100, 296, 132, 0),
                                                  (7, 17, 6, 0), (13, 3, 4, 0), (1, 1, 132, 0)])
def test_stream_k_plan_covers_every_step_once(tiles, steps, slots, sk):
    """Every (tile, K step) is done by exactly one program; a split tile's segments are numbered 0..n-1 in K order
    by programs that agree on n, n <= the plan's max_segs (the workspace's size); no program idles while another
    has more than one step beyond its share; whole tiles where the plan splits none."""
    from quant_serve.kernels.matmul.streamk import MIN_SK_STEPS, SK_ALIGNED_FILL, stream_k_plan
    plan = stream_k_plan(tiles, steps, slots, sk)
    assert plan.programs <= slots and plan.waves * plan.programs + plan.tail == tiles
    done, segs = {}, {}
    for p, items in _sk_work(plan, steps).items():
        for tile, k0, k1, seg, nseg, t in items:
            assert 0 <= k0 < k1 <= steps and 0 <= seg < nseg <= plan.max_segs, (p, tile, k0, k1, seg, nseg)
            for step in range(k0, k1):
                assert (tile, step) not in done
                done[tile, step] = p
            segs.setdefault(tile, []).append((k0, seg, nseg))
    assert len(done) == tiles * steps
    for tile, parts in segs.items():
        assert sorted(parts) == [(k0, i, len(parts)) for i, (k0, _, _) in enumerate(sorted(parts))], tile
    if plan.tail:
        tail_load = [sum(k1 - k0 for tile, k0, k1, *_ in items if tile >= plan.waves * plan.programs)
                     for items in _sk_work(plan, steps).values()][:plan.sk_programs]
        assert max(tail_load) - min(tail_load) <= 1
        if not sk:      # equal K ranges a tile where they fill SK_ALIGNED_FILL of a wave, else stream-K
            aligned = plan.sk_programs % plan.tail == 0 and plan.sk_programs >= SK_ALIGNED_FILL * slots
            assert aligned and plan.max_segs == plan.sk_programs // plan.tail or plan.sk_programs == min(
                slots, max(plan.tail, plan.tail * steps // MIN_SK_STEPS), plan.tail * steps)
    if sk == plan.tail or not plan.tail:
        assert plan.max_segs == 1 and all(n == 1 for parts in segs.values() for _, _, n in parts)


def test_plan_takes_the_tma_tile_where_the_caps_and_options_allow():
    """plan_w4a16 (what the forward runs, kernels --explain prints and kernels.py records): the TMA tile where the
    rule has one and the caps (probes included) and options allow it; the wgmma / mma.sync tile where TMA is off,
    x does not suit TMA or the card has none; dequantize + cuBLAS where neither has a tile."""
    from dataclasses import replace

    from quant_serve.kernels.gpu import PROFILES, KernelOptions
    from quant_serve.kernels.matmul.plan import plan_w4a16
    h200 = PROFILES["h200"]
    plan = lambda m, shape, caps=h200, **kw: plan_w4a16(m, *QWEN[shape], caps, **kw)  # noqa: E731
    assert plan(64, "gate_up").config == select_tma_config(64, *QWEN["gate_up"]) is not None
    assert plan(64, "gate_up").kernel == "tma"
    assert plan(256, "down").config == select_tma_config(256, *QWEN["down"]) is not None
    assert plan(16, "gate_up").kernel == "mma.sync" and isinstance(plan(16, "gate_up").config, MMAConfig)
    assert plan(17, "gate_up").config == select_tma_config(17, *QWEN["gate_up"]) is not None
    assert plan(4097, "gate_up").kernel == "dequant+cublas"
    wgmma = plan(64, "gate_up", tma_fits=False)
    assert wgmma.kernel == "wgmma" and wgmma.config.wgmma
    no_tma = plan(64, "gate_up", replace(h200, tma=False))                               # the probe failed
    assert (no_tma.kernel, no_tma.config) == ("wgmma", wgmma.config) and "no TMA" in no_tma.why
    off = plan(64, "gate_up", options=KernelOptions(tma=False))                           # turned off
    assert (off.kernel, off.config) == ("wgmma", wgmma.config) and "TMA off" in off.why
    fp16 = KernelOptions(activation_dtype="fp16")                # above 64 rows "auto" takes int8 there (w4a8)
    for card in ("a10", "4090", "a100"):                          # no TMA / wgmma: mma.sync to 64, then cuBLAS
        assert plan(64, "gate_up", PROFILES[card]).kernel == "mma.sync", card
        assert plan(65, "gate_up", PROFILES[card], options=fp16).kernel == "dequant+cublas", card
    assert "no TMA" in plan(65, "gate_up", PROFILES["a10"], options=fp16).why


def test_tma_probe_failure_falls_back_with_a_warning(caplog):
    """The TMA kernel serves only where its load probe passes (an sm90 GPU); a failed probe says what serves
    instead."""
    from quant_serve.kernels.matmul.probes import _tma_works
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() == (9, 0):
            assert _tma_works(torch.cuda.current_device())
        return
    with caplog.at_level("WARNING", logger="quant_serve"):
        assert _tma_works.__wrapped__(0) is False
    assert "TMA kernel unavailable" in caplog.text and "wgmma kernel up to 128 rows" in caplog.text


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="TMA with wgmma needs an sm90 GPU")


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
@pytest.mark.parametrize("k,n,group_size,zeros", [(512, 256, 128, True), (384, 192, 64, False),
                                                  (640, 272, 32, True), (1000, 80, -1, True),
                                                  (1088, 512, 64, True), (3584, 1024, 128, True)])
@pytest.mark.parametrize("m", [17, 64, 100, 256, 300])
def test_gpu_tma_matches_twin(k, n, group_size, zeros, m, monkeypatch):
    """Both consumer counts, 64-256 weight rows, x tiles past M, N past the tile (272, 80), K padded to 64 (1000);
    stream-K: the plan's split of the tail, none, odd step counts a program (1088 = 17 steps), and (few SMs
    assumed) whole waves before the tail; one consumer with each step's dequant beside the last wgmma (overlap; spans
    of odd and even step counts); steps of 128 K rows (2 and 4 scale groups a step at groups of 64 and 32, an odd 5
    steps at K = 640; K = 1088 falls back to 64). Twice each: the sum of a split tile's segments has one order."""
    import quant_serve.kernels.matmul.frag.tma as tma_module
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    fw, x, bias, ref = frag_case(k, n, group_size, zeros, m)
    for sms in (132, 3):
        monkeypatch.setattr(tma_module, "device_sms", lambda device, sms=sms: sms)
        for cfg in (dict(consumers=1, block_n=64), dict(consumers=1, block_n=128, sk_programs=5),
                    dict(consumers=1, block_n=64, overlap=True), dict(consumers=1, block_n=128, sk_programs=7,
                                                                      overlap=True),
                    dict(consumers=2, block_n=128, block_m=64, sk_programs=1), dict(consumers=2, block_n=256,
                                                                                  block_m=128),
                    dict(consumers=2, block_n=128, stages=6, sk_programs=3),
                    dict(consumers=1, block_n=64, block_k=128, overlap=True),
                    dict(consumers=1, block_n=64, block_m=128, block_k=128, stages=2, sk_programs=5),
                    dict(consumers=2, block_n=128, block_k=128, stages=2, sk_programs=3)):
            if cfg.get("block_m", 0) > 128 * cfg["consumers"]:
                continue
            y = w4a16_tma(x, fw, bias, **cfg)
            assert rel_err(y, ref) < 2e-3, (sms, cfg)
            assert torch.equal(y, w4a16_tma(x, fw, bias, **cfg)), (sms, cfg)


@pytest.mark.gpu
@sm90
@pytest.mark.timeout(300)
def test_gpu_tma_silu_mul_and_dispatch(monkeypatch):
    """The SwiGLU after the kernel; w4a16_forward takes the TMA kernel where the rule has a tile (a spy counts its
    calls, after the load probe has run as prepare_kernel_weights runs it) and gives the same result."""
    import quant_serve.kernels.matmul.frag.tma as tma_module
    from quant_serve.kernels.gpu import runtime_for
    from quant_serve.kernels.norm_act import silu_and_mul
    from quant_serve.kernels.matmul.dispatch import w4a16_forward
    from quant_serve.kernels.matmul.frag.layout import prepare_frag
    from quant_serve.kernels.matmul.probes import _tma_works
    from quant_serve.kernels.matmul.frag.tma import w4a16_tma
    assert _tma_works(torch.cuda.current_device())
    qweight, scales, qzeros, gs, _ = make_weights(1024, 512, 128, True, False, torch.float16)
    fw = prepare_frag(qweight, scales, qzeros, gs)
    for m in (40, 200, 700):
        x = torch.randn(m, 1024, dtype=torch.float16, device=DEV)
        ref = reference(x, qweight, scales, qzeros, gs, None, None)
        want = silu_and_mul(ref.to(torch.float16).to(DEV)).float().cpu()
        for sk in (0, 1, 7):
            assert rel_err(w4a16_tma(x, fw, consumers=1, silu_mul=True, sk_programs=sk), want) < 5e-3
        calls = []
        monkeypatch.setattr(tma_module, "w4a16_tma", lambda *a, **kw: calls.append(kw) or w4a16_tma(*a, **kw))
        assert rel_err(w4a16_forward(x, fw), ref) < 2e-3
        assert rel_err(w4a16_forward(x, fw, silu_mul=True), want) < 5e-3
        if runtime_for(x.device).tma:
            assert len(calls) == 2 and calls[1]["silu_mul"], m
        else:                                       # a GPU profile without TMA (--gpu-profile a10): never taken
            assert not calls, m
        monkeypatch.undo()


def compile_tma_cases() -> dict:
    """The dispatcher's TMA tiles compiled for sm90 (a fresh process: see the caller) -> registers, spills, SASS."""
    from triton.experimental.gluon import language as gl

    from quant_serve.kernels.matmul.frag.tma import _w4a16_tma_kernel, register_budget
    from kernel_helpers import compile_sm90
    out = {}
    cases = [(1, 64, 64, False, 64, 4, False), (1, 64, 128, True, 64, 4, True), (2, 128, 256, True, 64, 4, False),
             (2, 128, 64, False, 64, 4, False), (1, 64, 64, False, 128, 4, True), (1, 64, 128, True, 128, 2, False)]
    for cons, bn, bm, bias, bk, stages, overlap in cases:
        consumer_regs, producer_regs, maxnreg = register_budget(cons)
        wl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        xl = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float16)
        sig = dict(w_desc=f"tensordesc<i32[{bn // 16}, {2 * bk}],{wl!r}>",
                   x_desc=f"tensordesc<fp16[{bm}, {bk}],{xl!r}>",
                   s_ptr="*fp16", z_ptr="*i32", out_ptr="*fp16", ws_ptr="*fp32", bias_ptr="*fp16",
                   **{a: "i32" for a in ("M", "N", "KP", "m_tiles", "waves", "tail", "p_sk", "max_segs", "stride_om",
                                         "stride_sg", "stride_zg")})
        out[f"c{cons}-{bn}-{bm}-{bias}-k{bk}-s{stages}-{overlap}"] = compile_sm90(_w4a16_tma_kernel, sig, dict(
            HAS_BIAS=bias, GROUP=128, ZP_MODE=1, EVEN_N=True, PDL=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            STAGES=stages, CONSUMERS=cons, CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
            OVERLAP=overlap), 4, maxnreg)
    return out


def test_tma_kernel_compiles_for_sm90_without_spills():
    """Partitions with their own register budgets (setmaxnreg), wgmma with A from registers, 16-byte output stores
    (the epilogue through shared memory), no spills at the 128 registers that let two one-consumer programs share
    an SM: checked on any machine with the wheel's ptxas."""
    res = compiled_in_fresh_process("tests.kernels.matmul.test_kernels_w4a16_tma", "compile_tma_cases")
    for name, r in res.items():
        assert r["hgmma"] and r["setmaxnreg"] and r["stack"] == 0 and not r["ldsm"], (name, r)
        assert r["stg128"], (name, r)
        assert r["regs"] <= (128 if name.startswith("c1") else 168), (name, r)
