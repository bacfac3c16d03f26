"""The W4A8 twin (kernels/matmul/reference_int8.py): activations on the int8 grid give the W4A16 result to fp32
rounding, for integer zero points, symmetric weights and GGUF's float offsets; per-token and per-group scales."""
import pytest
import torch

from quant_serve.kernels.matmul.reference import pack_int4_cols, pack_int4_rows, w4a16_matmul_ref
from quant_serve.kernels.matmul.reference_int8 import act_group_size, quantize_activations, w4a8_matmul_ref


def _weights(k, n, gs, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // gs, n), generator=g)
    s = torch.rand(k // gs, n, generator=g) * 0.02 + 0.001
    return pack_int4_rows(q), pack_int4_cols(z), s


def _on_grid(x, act_group):
    xq, sx = quantize_activations(x, act_group)
    m, k = x.shape
    return (xq.float().view(m, -1, act_group) * sx[:, :, None]).view(m, k)


@pytest.mark.parametrize("act_scale", ["token", "group"])
@pytest.mark.parametrize("zeros", ["int4", "symmetric", "offsets"])
def test_int8_grid_inputs_give_the_w4a16_result(act_scale, zeros):
    k, n, gs, m = 256, 48, 64, 7
    qw, qz, s = _weights(k, n, gs)
    ag = act_group_size(act_scale, k, gs)
    x = _on_grid(torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3, ag)
    offsets = torch.randn(k // gs, n) * 0.01 if zeros == "offsets" else None
    qz = qz if zeros == "int4" else None
    ref = w4a16_matmul_ref(x, qw, s, qz, gs, offsets=offsets)
    out = w4a8_matmul_ref(x, qw, s, qz, gs, ag, offsets=offsets)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_quantization_error_is_bounded_and_blocks_are_independent():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    x[0, :64] *= 1000                                    # an outlier block: per-group scales keep it to its block
    xq, sx = quantize_activations(x, 64)
    assert xq.dtype == torch.int8 and sx.shape == (4, 4)
    back = (xq.float().view(4, 4, 64) * sx[:, :, None]).view(4, 256)
    assert ((back - x).abs() <= sx.repeat_interleave(64, dim=1) / 2 + 1e-6).all()
    assert sx[0, 1] == pytest.approx(x[0, 64:128].abs().max() / 127)
    zq, zs = quantize_activations(torch.zeros(2, 64), 64)  # an all-zero block: scale 1, codes 0, no NaN
    assert (zq == 0).all() and (zs == 1).all()


def test_half_inputs_and_leading_dims_and_bias():
    k, n, gs = 128, 32, 128
    qw, qz, s = _weights(k, n, gs, seed=3)
    x = torch.randn(2, 3, k, dtype=torch.float16)
    bias = torch.randn(n)
    out = w4a8_matmul_ref(x, qw, s.half(), qz, gs, k, bias=bias)
    ref = w4a16_matmul_ref(x.float(), qw, s, qz, gs, bias=bias)
    assert out.shape == (2, 3, n) and out.dtype == torch.float16
    assert ((out.float() - ref).norm() / ref.norm()) < 0.02


def test_activation_blocks_must_cover_whole_weight_groups():
    qw, qz, s = _weights(128, 16, 64)
    with pytest.raises(ValueError, match="whole weight groups"):
        w4a8_matmul_ref(torch.randn(1, 128), qw, s, qz, 64, 32)
    with pytest.raises(ValueError, match="granularity"):
        act_group_size("channel", 128, 64)
