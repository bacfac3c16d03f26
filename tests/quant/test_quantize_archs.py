"""One model definition for serving and calibration: the engine decoder's non-paged forward (what AWQ and GPTQ
calibrate on, engine/models/dense_calib.py) against transformers for every architecture, AWQ's folds as an FP
identity on Gemma (1 + w norms, sandwich norms) and Phi-3 (fused qkv / gate_up), and `quant-serve quantize` with
RTN, AWQ and GPTQ on Qwen3, Gemma 2 and Phi-3 checkpoints that load and generate."""
import pytest
import torch
from safetensors.torch import load_file

from helpers import bench_script, make_engine
from quant_serve.engine.load.loader import load_model_config
from quant_serve.engine.models.dense_calib import dense_logits
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.server.cli.main import main as cli
from quant_serve.server.cli.quantize import load_source
from random_archs import CONFIGS, VOCAB, hf_model, prompts, random_model_dir

quant_quality = bench_script("quant_quality")

def fp32_weights(path) -> dict[str, torch.Tensor]:
    return {k: v.float() for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dense_forward_matches_hf(name, arch_models):
    """The calibration forward is the served decoder: logits of a 150-token prompt (past Gemma's 24-token window,
    Phi-3's LongRoPE, partial rotary, soft-caps, q/k norms) equal transformers'."""
    path = arch_models(name)
    ids = torch.tensor([prompts()[2]])
    ours = dense_logits(load_model_config(path)[0], fp32_weights(path), ids)[0]
    with torch.no_grad():
        ref = hf_model(path)(ids).logits[0]
    torch.testing.assert_close(ours, ref, atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_awq_folds_keep_the_fp_block(name, arch_models):
    """AWQ's scales fold into Gemma's (1 + w) pre-MLP norm and Phi-3's fused v / up rows: the FP block is
    unchanged while every folded tensor changed (MHA here, so the v -> o fold runs too)."""
    from quant_serve.quant.awq import AWQSettings, awq_block
    path = random_model_dir(name, arch_models(name).parent / f"{name}-mha", {"num_key_value_heads": 4})
    source = load_source(path)
    w = {k.removeprefix("model.layers.0."): source.read(k).float() for k in source.tensor_names
         if k.startswith("model.layers.0.")}
    before = dict(w)
    x = source.model.embed(torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0)), "cpu")
    x[..., [3, 77, 100]] *= 20                          # outlier channels, so that no scale search keeps the identity
    block = source.model.block(0, 32, "cpu")
    awq_block(w, x, block, 64, False, AWQSettings(n_grid=4))
    folded = [block.qkv_norm, block.gate_up_norm, block.v_rows[0], block.up_rows[0]]
    for key in folded:
        assert not torch.equal(w[key + ".weight"], before[key + ".weight"]), key
    torch.testing.assert_close(block.forward(w, x), block.forward(before, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3"])
@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_cli_quantize_loads_and_generates(name, method, arch_models, tmp_path):
    """`quant-serve quantize` (calibration sampled from the model itself) on a Qwen3 (q/k norms), Gemma 2 (GeGLU,
    sandwich norms, soft-caps, window) or Phi-3 (fused qkv / gate_up) model; the engine runs the INT4 checkpoint
    exactly as the non-paged forward runs its dequantized weights, and generates."""
    out = tmp_path / "int4"
    assert cli(["quantize", str(arch_models(name)), str(out), "--method", method, "--group-size", "64",
                "--calib-samples", "4", "--calib-seq-len", "32", "--device", "cpu"]) == 0    # sampled from the model
    engine = make_engine(out, chunk=40)
    ids = prompts()[2][:64]
    expected = dense_logits(engine.model_config, quant_quality.dense_weights(out), torch.tensor([ids]))[0]
    torch.testing.assert_close(engine.score(ids), expected, atol=3e-4, rtol=1e-4)
    (result,) = engine.generate([prompts()[1]], SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
    assert len(result.outputs[0].token_ids) == 4


def test_calibration_input_errors(arch_models):
    model = load_source(arch_models("qwen3")).model
    with pytest.raises(ValueError, match="token id 4096 is outside the model's vocabulary of 4096"):
        model.embed(torch.tensor([[1, 4096]]), "cpu")
    with pytest.raises(ValueError, match="windows of 1025 tokens exceed the model's 1024 positions"):
        model.block(0, 1025, "cpu")
