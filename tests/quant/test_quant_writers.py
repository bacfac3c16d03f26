"""Writers: formats.md section 5 worked words, writer -> reader round trips, cross-format identities, RTN math."""
import pytest
import torch

from quant_serve.kernels.matmul.reference import unpack_int4_rows
from quant_serve.quant.formats import (awq_quantization_config, ct_quantization_config, gptq_quantization_config,
                                       load_quant_config, write_awq_gemm, write_gptq, write_pack_quantized)
from quant_serve.quant.formats.awq import unpack_awq
from quant_serve.quant.rtn import dequantize_codes, quantize_rtn

PREFIX = "model.layers.0.self_attn.o_proj"


def as_u32(t):
    return int(t) & 0xFFFFFFFF


def load(cfg: dict, tensors: dict, k: int, prefix: str = PREFIX):
    names = {f"{prefix}.{s}" for s in tensors}
    qc = load_quant_config({"quantization_config": cfg}, None, names)
    n = tensors["scales"].shape[1] if "scales" in tensors else tensors["weight_scale"].shape[0]
    layer = qc.make_linear(k, [n], "bias" in tensors, torch.float32, "cpu", [prefix])
    layer.load_shard(0, tensors, prefix)
    layer.finalize()
    return layer


# ---- section 5 worked words ------------------------------------------------------------------------------

def test_worked_words():
    ones = torch.ones(1, 8)
    q_k = torch.arange(8).repeat(8, 1)                                 # q[n, k] = k
    q_n = torch.arange(8).view(8, 1).repeat(1, 8)                      # q[n, k] = n
    gptq = write_gptq(q_k, ones, None, 8)
    assert all(as_u32(w) == 0x76543210 for w in gptq["qweight"][0])
    ct = write_pack_quantized(q_k, ones, None, 8)
    assert all(as_u32(w) == 0x76543210 for w in ct["weight_packed"][:, 0])
    awq = write_awq_gemm(q_n, ones, None, 8)
    assert all(as_u32(w) == 0x75316420 for w in awq["qweight"][:, 0])
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert as_u32(gptq["qzeros"][0, 0]) == 0x77777777                 # v1 sym: z = 8 stored as 7
    v2 = write_gptq(q_k, ones, None, 8, checkpoint_format="gptq_v2")
    assert int(v2["qzeros"][0, 0]) == -2004318072 and as_u32(v2["qzeros"][0, 0]) == 0x88888888
    assert as_u32(awq["qzeros"][0, 0]) == 0x88888888                  # AWQ sym written as real z = 8


def _autogptq_pack_zeros(z):
    """AutoGPTQ pack(): zeros -= 1, then OR-ed in as uint32, so -1 wipes every higher nibble."""
    word = 0
    for j, zj in enumerate(z):
        word |= ((zj - 1) & 0xFFFFFFFF) << (4 * j)
    return word & 0xFFFFFFFF


def _gptqmodel_v2_to_v1(z):
    """GPTQModel: subtract 0x11111111 from the whole v2 word, so a 0 nibble borrows from the next."""
    return (sum(zj << (4 * j) for j, zj in enumerate(z)) - 0x11111111) & 0xFFFFFFFF


@pytest.mark.parametrize("tool, expected", [(_autogptq_pack_zeros, 0xFFFFFFFF), (_gptqmodel_v2_to_v1, 0x2222223F)])
def test_v1_asym_zero_point_0_corruption_is_refused(tool, expected):
    z = [0, 5, 3, 3, 3, 3, 3, 3]
    word = tool(z)
    assert word == expected
    k, n = 8, 8
    tensors = {"qweight": torch.zeros(1, n, dtype=torch.int32), "scales": torch.ones(1, n).half(),
               "qzeros": torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32),
               "g_idx": torch.zeros(k, dtype=torch.int32)}
    cfg = gptq_quantization_config(-1, sym=False, checkpoint_format="gptq_v2") | {"checkpoint_format": "gptq",
                                                                                    "format": "gptq"}
    with pytest.raises(ValueError, match=rf"{PREFIX}\.qzeros\[0, 0\] = 0x{expected:08X}.*0xF nibble"):
        load(cfg, tensors, k)
    with pytest.raises(ValueError, match="v1"):
        write_gptq(torch.zeros(n, k, dtype=torch.int32), torch.ones(1, n), torch.tensor([z]), -1)
    with pytest.raises(ValueError, match="gptq_v2"):
        gptq_quantization_config(128, sym=False, checkpoint_format="gptq")


def test_v2_word_carries_round_trip():
    z = [0, 5, 3, 3, 3, 3, 3, 3]
    assert (0x2222223F + 0x11111111) & 0xFFFFFFFF == 0x33333350       # GPTQModel's own v1 -> v2 read
    t = write_gptq(torch.zeros(8, 8, dtype=torch.int32), torch.ones(1, 8), torch.tensor([z]), -1,
                   checkpoint_format="gptq_v2")
    assert as_u32(t["qzeros"][0, 0]) == 0x33333350
    layer = load(gptq_quantization_config(-1, sym=False, checkpoint_format="gptq_v2"), t, 8)
    assert layer.dequantized_weight()[:, 0].tolist() == [-zj for zj in z]


# ---- writer -> reader round trips ------------------------------------------------------------------------

def rtn_case(gs, sym, n=32, k=256, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return w, *quantize_rtn(w, 4, gs, sym)


CASES = [("awq", False), ("awq", True), ("gptq", True), ("gptq_v2", True), ("gptq_v2", False), ("ct", True),
         ("ct", False)]


def write(fmt, q, s, z, gs, g_idx=None):
    if fmt == "awq":
        return awq_quantization_config(gs), write_awq_gemm(q, s, z, gs)
    if fmt.startswith("gptq"):
        sym = z is None
        return (gptq_quantization_config(gs, sym, g_idx is not None, fmt),
                write_gptq(q, s, z, gs, g_idx, checkpoint_format=fmt))
    return ct_quantization_config(gs, z is None), write_pack_quantized(q, s, z, gs, scale_dtype=torch.bfloat16)


@pytest.mark.parametrize("gs", [32, 64, 128, -1])
@pytest.mark.parametrize("fmt, sym", CASES)
def test_writer_reader_round_trip(fmt, sym, gs):
    w, q, s, z = rtn_case(gs, sym)
    cfg, tensors = write(fmt, q, s, z, gs)
    layer = load(cfg, tensors, w.shape[1])
    written_scales = (tensors["scales"] if "scales" in tensors else tensors["weight_scale"].t()).float()
    assert torch.equal(layer.dequantized_weight(), dequantize_codes(q, written_scales, z, gs))
    assert torch.equal(unpack_int4_rows(layer.qweight), q.t())        # codes survive bit for bit


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_act_order_round_trip(fmt):
    n, k, gs = 16, 128, 32
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(k // gs, n, generator=gen) + 0.01
    z = None if fmt == "gptq" else torch.randint(0, 16, (k // gs, n), generator=gen, dtype=torch.int32)
    g_idx = (torch.arange(k) // gs)[torch.randperm(k, generator=gen)]
    cfg, tensors = write(fmt, q, s, z, gs, g_idx)
    layer = load(cfg, tensors, k)
    assert layer.perm is not None
    assert torch.equal(layer.dequantized_weight(), dequantize_codes(q, s.half().float(), z, gs, g_idx))
    with pytest.raises(ValueError, match="act-order"):
        write_awq_gemm(q, s, z, gs, g_idx)
    with pytest.raises(ValueError, match="act-order"):
        write_pack_quantized(q, s, z, gs, g_idx)


def test_ct_sym_equals_gptq_sym():
    _, q, s, _ = rtn_case(128, True)
    gptq = write_gptq(q, s, None, 128)
    ct = write_pack_quantized(q, s, None, 128, scale_dtype=torch.float16)
    assert torch.equal(ct["weight_packed"], gptq["qweight"].t())
    assert torch.equal(ct["weight_scale"], gptq["scales"].t())
    assert all(as_u32(v) == 0x77777777 for v in gptq["qzeros"].flatten())
    a = load(gptq_quantization_config(128), gptq, 256)
    b = load(ct_quantization_config(128), ct, 256)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert a.qzeros is None and b.qzeros is None


def test_awq_converts_to_the_gptq_like_layout():
    _, q, s, z = rtn_case(64, False)
    awq = load(awq_quantization_config(64), write_awq_gemm(q, s, z, 64), 256)
    v2 = load(gptq_quantization_config(64, False, checkpoint_format="gptq_v2"),
              write_gptq(q, s, z, 64, checkpoint_format="gptq_v2"), 256)
    for name in ("qweight", "scales", "qzeros"):
        assert torch.equal(getattr(awq, name), getattr(v2, name))


def test_bias_is_written_and_read():
    w, q, s, z = rtn_case(64, False, n=16, k=64)
    bias = torch.randn(16)
    layer = load(awq_quantization_config(64), write_awq_gemm(q, s, z, 64, bias=bias), 64)
    assert torch.equal(layer.bias, bias.half().float())


# ---- RTN math --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sym", [False, True])
def test_rtn_math(sym):
    w, q, s, z = rtn_case(64, sym)
    assert q.dtype == torch.int32 and 0 <= int(q.min()) and int(q.max()) <= 15 and s.shape == (4, 32)
    err = (dequantize_codes(q, s, z, 64) - w).abs()
    assert bool((err <= s.repeat_interleave(64, 0).t() / 2 + 1e-7).all())   # round to nearest within range
    wg = w.view(32, 4, 64)
    if sym:
        assert z is None and torch.allclose(s, 2 * wg.abs().amax(-1).t() / 15)
    else:
        wmin, wmax = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        assert torch.allclose(s, ((wmax - wmin) / 15).t())
        assert torch.equal(z, torch.round(-wmin.t() / s).clamp(0, 15).to(torch.int32))


def test_rtn_zero_group_and_partial_group():
    w = torch.zeros(8, 96)
    w[:, 64:] = torch.linspace(-1, 1, 32)
    q, s, z = quantize_rtn(w, 4, 64, sym=False)
    assert s.shape == (2, 8) and torch.equal(dequantize_codes(q, s, z, 64)[:, :64], w[:, :64])
