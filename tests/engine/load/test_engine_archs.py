"""Qwen3, Gemma 2, Gemma 3, Phi-3 (and Phi-4-mini's partial rotary) and Llama 3.2 (tied head): small random-weight
models built from each family's transformers config, through our engine against transformers on CPU (fp32):
logits of a long prompt (past Gemma's sliding window) and greedy tokens; then the INT4 path, quantized by our RTN
into AWQ / GPTQ checkpoints, against transformers on the dequantized weights."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import Gemma3TextConfig

from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, make_engine
from random_archs import CONFIGS, WINDOW, hf_model, prompts

def check_against_hf(engine, ref_model, atol=3e-4):
    ids = prompts()[2]
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(engine.score(ids), ref, atol=atol, rtol=1e-4)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    for prompt, out in zip(prompts(), engine.generate(prompts(), params)):
        with torch.no_grad():
            expected = ref_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                          attention_mask=torch.ones(1, len(prompt)))
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist(), f"{len(prompt)}-token prompt"
    assert_all_blocks_free(engine)


def header_bytes(path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(f.get_tensor(n).nbytes for n in f.keys())
    return total


def plan_weights(path) -> int:
    """The memory plan's weight bytes computed from config.json alone (no safetensors header)."""
    from quant_serve.engine.plan.memory import plan_memory
    plan = plan_memory(json.loads((path / "config.json").read_text()))
    assert plan.weights_source == "config"
    return plan.weights_bytes


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_match_hf(name, arch_models):
    path = arch_models(name)
    assert plan_weights(path) == header_bytes(path)          # norms, q/k norms, fused modules, tied head counted
    engine = make_engine(path, chunk=40)
    cfg = engine.model_config
    if name.startswith("gemma"):
        assert cfg.gemma_norm and cfg.sandwich_norms and WINDOW in cfg.layer_windows and 0 in cfg.layer_windows
    assert (engine.model.lm_head is None) == cfg.tie_word_embeddings
    check_against_hf(engine, hf_model(path))


def rtn_source(path):
    """A SourceModel without a forward (RTN reads none), as server/cli/quantize.load_source builds it otherwise."""
    from quant_serve.engine.load.checkpoint import INDEX, list_weight_files, read_tensor_names
    from quant_serve.engine.load.loader import load_model_config
    from quant_serve.quant.quantize import SourceModel
    cfg, raw = load_model_config(path)
    names = read_tensor_names(list_weight_files(path), path / INDEX)

    def read(name):
        with safe_open(str(names[name]), framework="pt") as f:
            return f.get_tensor(name)
    extra = [p for p in path.iterdir() if p.suffix in (".json", ".jinja") and p.name != "config.json"
             and not p.name.startswith("model")]
    return SourceModel(cfg.num_layers, raw, list(names), read, extra, path)


INT4_FORMATS = {"qwen3": "awq", "gemma2": "gptq", "gemma3": "awq", "phi3": "gptq", "phi4-mini": "awq",
                "llama3.2": "gptq"}


@pytest.mark.parametrize("name", list(INT4_FORMATS))
def test_int4_rtn_checkpoint_matches_hf_on_dequantized_weights(name, arch_models, tmp_path):
    """`quant-serve quantize --method rtn` into AWQ / GPTQ (Phi's fused qkv_proj / gate_up_proj stay fused, as
    AutoAWQ and GPTQModel write them), loaded by our readers and run on the INT4 path, against transformers with
    every linear replaced by its dequantized weights."""
    from quant_serve.quant.layers.linear import QuantLinear
    from quant_serve.quant.quantize import QuantizeConfig, quantize_model
    src, fmt = arch_models(name), INT4_FORMATS[name]
    results = {}
    quantize_model(rtn_source(src), None, QuantizeConfig(method="rtn", group_size=64, format=fmt, sym=fmt == "gptq"),
                   tmp_path / "int4", show_progress=False, results_sink=results)
    assert json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["quant_method"] == fmt
    fused = name.startswith("phi")
    per_block = {n.split(".", 3)[3] for n in results}
    assert per_block == ({"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"} if fused
                         else {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    ref = hf_model(src)
    state = ref.state_dict()
    for module, res in results.items():
        state[f"{module}.weight"] = res.dequantize(64)
    ref.load_state_dict(state)
    assert plan_weights(tmp_path / "int4") == header_bytes(tmp_path / "int4")
    engine = make_engine(tmp_path / "int4", chunk=40)
    layer = engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    check_against_hf(engine, ref)


def test_quantize_refuses_calibrated_methods_without_a_forward(arch_models, tmp_path):
    from quant_serve.quant.quantize import QuantizeConfig, quantize_model
    with pytest.raises(ValueError, match="calibrates on the model's forward.*use --method rtn"):
        quantize_model(rtn_source(arch_models("gemma2")), torch.zeros(1, 8, dtype=torch.long),
                       QuantizeConfig(method="gptq"), tmp_path / "out", show_progress=False)


def test_plan_counts_gemma3_12b_weights_and_kv(tmp_path):
    """Gemma 3 12B's real config: the plan's KV per token uses head_dim 256 (not hidden / heads = 240), and its
    weight bytes are exactly our decoder's parameters (built on the meta device: no memory)."""
    from quant_serve.engine.load.loader import build_model, load_model_config
    from quant_serve.engine.plan.memory import plan_memory
    config = Gemma3TextConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=1024, max_position_embeddings=131072, dtype="bfloat16",
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    raw = config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plan = plan_memory(raw, gpu_mem_gb=24)
    assert plan.kv_bytes_per_token == 2 * 48 * 8 * 256 * 2 and plan.max_position_embeddings == 131072
    cfg, _ = load_model_config(tmp_path)
    assert cfg.layer_windows.count(0) == 8 and cfg.local_rope_theta == 10000.0
    cfg.max_position_embeddings = 16                      # the rope tables are no weights
    model = build_model(cfg, torch.bfloat16, "meta", None)
    assert plan.weights_bytes == sum(p.numel() * 2 for p in model.parameters())
