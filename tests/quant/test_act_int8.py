"""Int8 activations (issue #53) on the CPU path: --activation-dtype reaches every quantized layer, which then runs
the W4A8 / W8A8 torch twin exactly and within the activation rounding's bound of the fp16 path; auto resolves per
weight format from kernels/matmul/int8/eligibility.py; eval names each candidate's path; bad values fail clearly."""
import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from quant_serve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.kernels.gpu import KernelOptions
from quant_serve.kernels.matmul.int8 import eligibility
from quant_serve.kernels.matmul.reference_int8 import act_group_size, quantize_activations, w4a8_matmul_ref
from quant_serve.kernels.matmul.reference_int8_codes import w8_act_group_size, w8a8_matmul_ref
from quant_serve.kernels.matmul.planes.q6k import Q6_GROUP, q6k_codes, q6k_scales
from quant_serve.quant.activations import check_activation_device, resolve_act_scale
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.layers.w8 import W8Linear
from quant_serve.server.cli.main import build_parser, main
from quant_serve.server.cli.engine_args import engine_config_from_args

TEXT = textwrap.dedent(json.__doc__ + textwrap.__doc__ + shutil.__doc__)


def demo_engine(activation_dtype: str = "auto", act_scale: str = "group", config: EngineConfig | None = None):
    config = config or EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu",
                                    kernels=KernelOptions(activation_dtype=activation_dtype, act_scale=act_scale))
    config.dtype, config.cache, config.max_model_len = "float32", CacheConfig(num_gpu_blocks=64), 1024
    config.scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    return LLMEngine(config, show_progress=False)


def rounding_bound(x: torch.Tensor, w: torch.Tensor, act_group: int) -> torch.Tensor:
    """|x W^T - x_int8 W^T| <= sum_k s_x(k) / 2 |W[n, k]|: round to nearest moves each input by at most half its
    block's step. x [M, K], w [N, K] -> [M, N]."""
    _, sx = quantize_activations(x, act_group)
    step = sx.repeat_interleave(act_group, dim=1)[:, :x.shape[1]]
    return (step / 2) @ w.abs().t()


def test_the_flag_reaches_every_quantlinear_which_runs_the_w4a8_twin():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu", "--activation-dtype", "int8",
                                      "--act-scale", "token"])
    config = engine_config_from_args(args)
    assert (config.kernels.activation_dtype, config.kernels.act_scale) == ("int8", "token")
    engine = demo_engine(config=config)
    layers = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 32 and {m.act_scale for m in layers} == {"token"}
    assert engine.activations.summary() == "int8/token"
    layer = engine.model.model.layers[3].mlp.down_proj
    k = layer.in_features
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(0)) * 0.5
    x[0, 7] = 40.0                                         # an outlier channel: coarse steps for its whole row
    y = layer(x)
    assert torch.equal(y, w4a8_matmul_ref(x, layer.qweight, layer.scales, layer.qzeros, layer.group_size, k,
                                          layer.perm, layer.bias))
    layer.act_scale = None
    y16 = layer(x)
    err = (y - y16).abs()
    assert (err <= rounding_bound(x, layer.dequantized_weight(), k) + 1e-4).all()
    rel = (err.norm(dim=1) / y16.norm(dim=1))
    assert (rel > 1e-4).all() and rel[1:].max() < 0.02 and rel[0] > rel[1:].max()   # the outlier row pays most


def test_int8_scores_stay_close_to_fp16_and_group_scales_closer_than_token():
    ids = demo_engine("fp16").tokenizer.encode(TEXT)[:384]
    logp = {path: demo_engine(*path).score(ids).log_softmax(-1)
            for path in [("fp16", "group"), ("int8", "token"), ("int8", "group")]}
    ref = logp[("fp16", "group")]
    kld = {path: (ref.exp() * (ref - lp)).sum(-1).mean().item() for path, lp in logp.items()}
    assert kld[("fp16", "group")] == 0
    assert 0 < kld[("int8", "group")] < kld[("int8", "token")] < 0.01     # measured 0.0005 / 0.0014 at 2k tokens


def _w8_layer(kind: str) -> W8Linear:
    layer = W8Linear(256, [40, 24], True, torch.float32, "cpu", None, 16 if kind == "q6k" else 32, ["a", "b"])
    layer.q6k_planes, layer.q5k_planes = kind == "q6k", kind == "q5k"
    gen = torch.Generator().manual_seed(1)
    layer.init_dummy(gen)
    layer.bias = torch.randn(64, generator=gen) * 0.1
    if kind in ("q8_0", "offsets"):                          # file-like: a scale per group, Q5_1's offsets
        layer.qweight = torch.randint(-127, 128, (256, 64), generator=gen, dtype=torch.int8)
        layer.scales = torch.rand(8, 64, generator=gen) * 1e-3 + 1e-4
        layer.offsets = torch.randn(8, 64, generator=gen) * 0.01 if kind == "offsets" else None
    return layer


@pytest.mark.parametrize("kind", ["q8_0", "offsets", "q6k", "q5k"])
@pytest.mark.parametrize("act_scale", ["token", "group"])
def test_w8linear_int8_is_the_w8a8_twin(kind, act_scale):
    layer = _w8_layer(kind)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    y16 = layer(x)
    layer.act_scale = act_scale
    ag = w8_act_group_size(act_scale, 256, 16 if kind == "q6k" else 32)
    assert ag == (256 if act_scale == "token" else 32)       # Q6_K's groups of 16 read activations per 32
    y = layer(x)
    assert (y - y16).abs().max() > 0
    assert ((y - y16).abs() <= rounding_bound(x, layer.dequantized_weight(), ag) + 1e-4).all()
    xq, sx = quantize_activations(x, ag)                     # inputs on the int8 grid: int8 == fp16, to rounding
    on_grid = (xq.float().view(5, -1, ag) * sx[:, :, None]).view(5, 256)
    layer.act_scale = None
    want = layer(on_grid)
    layer.act_scale = act_scale
    torch.testing.assert_close(layer(on_grid), want, rtol=1e-5, atol=1e-5)
    if kind == "q6k":
        w = layer._native()
        assert torch.equal(y, w8a8_matmul_ref(x, q6k_codes(w), q6k_scales(w), None, Q6_GROUP, ag, layer.bias))


def test_w8a8_refuses_blocks_that_split_weight_groups():
    with pytest.raises(ValueError, match="whole weight groups"):
        w8a8_matmul_ref(torch.randn(1, 64), torch.zeros(64, 4, dtype=torch.int8), torch.ones(2, 4), None, 32, 48)
    with pytest.raises(ValueError, match="granularity"):
        w8_act_group_size("channel", 64, 32)
    assert act_group_size("group", 512, 128) == 128 and w8_act_group_size("group", 512, 128) == 128


def test_auto_resolves_per_weight_format_from_the_eligibility_table(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(eligibility, "INT8_ACTIVATIONS_FREE", {"awq": ("group",), "gguf:Q8_0": ("token", "group")})
    auto_group, auto_token = KernelOptions("this", activation_dtype="auto"), \
        KernelOptions("this", activation_dtype="auto", act_scale="token")
    assert resolve_act_scale(auto_group, ["awq"], cpu) == "group"
    assert resolve_act_scale(auto_token, ["awq"], cpu) is None              # passed at group scales only
    assert resolve_act_scale(auto_group, ["gguf:Q4_K", "gguf:Q8_0"], cpu) is None   # a merged layer needs both
    assert resolve_act_scale(auto_group, ["gptq"], cpu) is None
    assert resolve_act_scale(auto_group, ["awq"], cuda) == "group"          # a ceiling: the GPU plan decides by speed
    assert resolve_act_scale(auto_group, ["gptq"], cuda) is None
    assert resolve_act_scale(KernelOptions(activation_dtype="int8", act_scale="token"), ["gptq"], cpu) == "token"
    assert resolve_act_scale(KernelOptions(activation_dtype="fp16"), ["awq"], cpu) is None
    engine = demo_engine("auto")                                            # the demo model is AWQ
    assert engine.activations.summary() == "int8/group"
    assert "auto -> int8/group: awq x 32 -> int8/group" in engine.activations.describe()
    check_activation_device(KernelOptions(activation_dtype="int8"), "cuda:0")    # the W4A8 kernels run there
    with pytest.raises(ValueError, match="'int4'"):
        check_activation_device(KernelOptions(activation_dtype="int4"), "cpu")


def test_the_shipped_table_only_lists_what_passed_the_measured_gate():
    results = Path(__file__).resolve().parents[2] / "bench" / "results" / "act-int8-accuracy-tiny-qwen2.json"
    rows = json.loads(results.read_text())["rows"]
    for fmt, scales in eligibility.INT8_ACTIVATIONS_FREE.items():
        measured = [r for r in rows.values() if fmt in r["weight_formats"]]
        assert measured, f"{fmt} is in the table but was never measured"
        for scale in scales:
            assert all(r["gate"][f"int8_{scale}"] for r in measured), f"{fmt} at {scale} scales failed the gate"
    engine = demo_engine("auto")
    want = "int8/group" if "group" in eligibility.INT8_ACTIVATIONS_FREE.get("awq", ()) else "fp16"
    assert engine.activations.summary() == want


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--activation-dtype", "int4"], "invalid choice: 'int4'"),
    (["generate", "--prompt", "x", "--act-scale", "channel"], "invalid choice: 'channel'"),
    (["serve", "--activation-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["eval", "--reference", "r", "--data", "d", "--activation-dtype", "fp16", "w8"], "invalid choice: 'w8'"),
])
def test_bad_values_exit_2_naming_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "choose from" in err


def test_on_cuda_auto_keeps_fp16_on_layers_whose_format_missed_the_gate(monkeypatch):
    """One accuracy table for both paths: on CUDA, plan_activations marks the fragment-layout weights of an
    ineligible format fp16, and the W4A8 plan then keeps them off int8 even inside an M band where it pays."""
    from torch import nn

    from quant_serve.kernels.matmul import dispatch
    from quant_serve.kernels.matmul.frag.layout import prepare_frag
    from quant_serve.kernels.matmul.int8 import rules
    from quant_serve.kernels.matmul.plan import plan_w4a16
    from quant_serve.kernels.gpu import PROFILES
    from quant_serve.quant.activations import plan_activations
    layer = next(m for m in demo_engine("fp16").model.modules() if isinstance(m, QuantLinear) and m.parts is None)
    layer.packed = prepare_frag(layer.qweight, layer.scales.half(), layer.qzeros, layer.group_size)
    model = nn.Sequential(layer)
    caps = PROFILES["a10"]
    monkeypatch.setitem(rules.W4A8_AUTO_M, caps.family, (64, 1 << 30))     # as if int8 paid on this card
    auto = KernelOptions(activation_dtype="auto", act_scale="group")

    def kernel(options):
        w = layer.packed
        return plan_w4a16(256, w.in_features, w.out_features, caps, dispatch.layer_options(options, w), "frag",
                          torch.float16, False, False, w.zp_mode, w.group_size).kernel

    monkeypatch.setattr(eligibility, "INT8_ACTIVATIONS_FREE", {})               # awq has not met the gate
    plan_activations(model, auto, "cuda")
    assert layer.packed.activation_dtype == "fp16" and kernel(auto) != "w4a8"
    monkeypatch.setattr(eligibility, "INT8_ACTIVATIONS_FREE", {"awq": ("group",)})
    plan = plan_activations(model, auto, "cuda")
    assert layer.packed.activation_dtype is None and kernel(auto) == "w4a8"
    assert plan.summary() == "int8/group" and layer.act_scale is None       # the CPU twin's switch stays off
    plan_activations(model, KernelOptions(activation_dtype="int8"), "cuda")      # asked for: no per-layer word
    assert layer.packed.activation_dtype is None
