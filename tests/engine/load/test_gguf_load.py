"""GGUF files of the trained tiny model (written here, tests/gguf_fixtures.py) load and score like transformers on the
gguf-dequantized weights; one serves through the OpenAI API; llama's q/k permutation is undone; split files,
errors."""
import math
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from fixtures import copy_tokenizer
from gguf_fixtures import write_gguf
from helpers import make_engine
from server_common import running_server

MIXES = ("Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M")
MERGED = "merged Q4_K / Q5_K + Q6_K (each run of shards in its own layout, outputs concatenated)"
Q5K = "Q5_K (5-bit: W4A16 fragment layout, 6 bits, on CUDA fp16; else W8A16 kernels, planes, 5.625 bits)"
Q4_K_M_PATHS = f"20 INT4 Q4_K (W4A16, two-level scales, 4.625 bits), 4 {MERGED}, 8 8-bit (W8A16)"   # as logged
Q5_K_M_PATHS = f"4 {MERGED}, 20 {Q5K}, 8 8-bit (W8A16)"     # down_proj (K = 1408) falls back to Q5_1 / Q8_0
NUM_TOKENS = 192


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, trained_model):
    directory = tmp_path_factory.mktemp("gguf")
    for mix in MIXES:
        write_gguf(trained_model, directory / f"tiny-{mix}.gguf", mix)
    return directory


@pytest.fixture(scope="module")
def held_out_ids(trained_model, heldout_text):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(trained_model)).encode(heldout_text[:4000])[:NUM_TOKENS]


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given logits [T, V] of ids."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean())


def _transformers_nll(path, ids: list[int], model_dir) -> float:
    """transformers' Qwen2 (model_dir's config) on weights that gguf.quants.dequantize gives for every tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    state = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight":
            continue                                                     # tied to the embeddings
        base, suffix = name.rsplit(".", 1)
        t = tensors[f"{name_map.get_name(base)}.{suffix}"]
        state[name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(param.shape)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return _nll(logits, ids)


@pytest.mark.parametrize("mix", MIXES)
def test_perplexity_matches_transformers_on_dequantized_weights(gguf_dir, held_out_ids, mix, trained_model):
    path = gguf_dir / f"tiny-{mix}.gguf"
    engine = make_engine(path, num_blocks=16, max_model_len=256)
    assert engine.tokenizer.encode("hello world, this is a test") == \
        [2105, 474, 2002, 14, 638, 347, 261, 1321]                       # the GGUF tokenizer is the model's
    ours = _nll(engine.score(held_out_ids), held_out_ids)
    reference = _transformers_nll(path, held_out_ids, trained_model)
    assert abs(math.exp(ours) / math.exp(reference) - 1) < 1e-3, (math.exp(ours), math.exp(reference))
    assert math.exp(ours) < 200                                          # a working model, not noise
    paths = engine.quant_config.describe_paths()
    assert paths == {"Q4_K_M": Q4_K_M_PATHS,
                     "Q5_K_M": Q5_K_M_PATHS}.get(mix, "32 INT4 (W4A16, float offsets)")


def test_split_files_and_directory(gguf_dir, tmp_path, trained_model):
    """A directory holding one model's split parts reads as the single file: the same tensors, bytes and config."""
    from quant_serve.engine.load.gguf.loader import gguf_files, gguf_model_config, open_gguf
    single = open_gguf(gguf_files(gguf_dir / "tiny-Q4_0.gguf"))
    write_gguf(trained_model, tmp_path / "tiny-Q4_0.gguf", "Q4_0", split_max_tensors=60)
    files = gguf_files(tmp_path)
    assert [p.name for p in files] == ["tiny-Q4_0-00001-of-00002.gguf", "tiny-Q4_0-00002-of-00002.gguf"]
    assert gguf_files(files[1]) == files
    split = open_gguf(files)
    assert sorted(split.tensors) == sorted(single.tensors)
    assert all(np.array_equal(split.tensors[n].data, t.data) for n, t in single.tensors.items())
    assert gguf_model_config(split) == gguf_model_config(single)
    files[1].unlink()
    with pytest.raises(FileNotFoundError, match="missing: tiny-Q4_0-00002-of-00002.gguf"):
        make_engine(tmp_path, num_blocks=8, max_model_len=128)


def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'.*supported: llama, qwen2, qwen3"):
        make_engine(tmp_path / "m.gguf", num_blocks=8, max_model_len=128)


def test_two_models_in_one_directory(gguf_dir):
    with pytest.raises(ValueError, match="more than one GGUF model"):
        make_engine(gguf_dir, num_blocks=8, max_model_len=128)


def test_served_through_openai_api(gguf_dir, held_out_ids, tmp_path, trained_model):
    """The Q4_K_M file behind `quant-serve serve`: echo logprobs give the engine's perplexity; chat uses the
    GGUF's template."""
    import httpx
    path = gguf_dir / "tiny-Q4_K_M.gguf"
    ids = held_out_ids[:96]
    args = [str(path), "--num-gpu-blocks-override", "32", "--max-model-len", "256", "--dtype", "float32",
            "--served-model-name", "tiny-gguf"]
    with running_server(args, tmp_path / "server.log") as server:
        body = {"model": "tiny-gguf", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        served = -float(np.mean(r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]))
        chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-gguf", "messages": [{"role": "user", "content": "Define: hellhound"}], "max_tokens": 8,
            "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] > 5          # the template's role markers were rendered
        assert Q4_K_M_PATHS in server.log()
    assert served == pytest.approx(_transformers_nll(path, ids, trained_model), rel=1e-4)


def test_copy_of_gguf_without_config_is_detected(gguf_dir, tmp_path, random_model):
    shutil.copy(gguf_dir / "tiny-Q4_1.gguf", tmp_path / "model.gguf")
    from quant_serve.engine.load.gguf.loader import gguf_files
    assert gguf_files(tmp_path) == [tmp_path / "model.gguf"]
    assert gguf_files(random_model) is None                                    # a safetensors directory


def _loaded_bytes(model) -> int:
    """What the model holds on CUDA: its CPU buffers, with scales and offsets in the model dtype (fp16 here), and
    each Q6_K / Q5_K layer in the fragment layout the CUDA fp16 model converts its planes to (frag6_bytes,
    frag5_bytes)."""
    from quant_serve.kernels.matmul.frag.q5k import frag5_bytes
    from quant_serve.kernels.matmul.frag.q6k import frag6_bytes
    from quant_serve.quant.layers.w8 import W8Linear
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    planes = {name: frag6_bytes if m.q6k_planes else frag5_bytes for name, m in model.named_modules()
              if isinstance(m, W8Linear) and (m.q6k_planes or m.q5k_planes)}
    total += sum(planes[name](m.in_features, m.out_features) for name, m in model.named_modules() if name in planes)
    for name, b in model.named_buffers():
        owner, leaf = name.rsplit(".", 1)
        if owner in planes and leaf != "bias":
            continue
        if leaf in ("qweight", "bias"):
            total += b.numel() * b.element_size()
        elif leaf in ("scales", "offsets"):                          # fp32 -> fp16; int16 / int8 codes as they are
            total += b.numel() * min(b.element_size(), 2)
        elif leaf == "superscales":                                  # Q4_K / Q5_K's int32 d | dmin
            total += b.numel() * b.element_size()
    return total


@pytest.mark.parametrize("mix,source", [("Q4_K_M", "gguf: Q4_K x 45, Q8_0 x 4, Q6_K x 4, Q5_0 x 4"),
                                        ("Q5_K_M", "gguf: Q5_K x 45, Q8_0 x 4, Q6_K x 4, Q5_1 x 4")])
def test_plan_counts_gguf_bytes_by_type(gguf_dir, capsys, mix, source):
    """`quant-serve plan X.gguf` reads the tensor table only; its weight bytes are those the fp16 model holds on
    CUDA."""
    import json

    from quant_serve.engine.load.loader import load_model, load_model_config
    from quant_serve.server.cli.main import main
    path = gguf_dir / f"tiny-{mix}.gguf"
    assert main(["plan", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_source"] == source
    cfg, _ = load_model_config(path)
    model, _ = load_model(path, cfg, torch.float16, "cpu", show_progress=False)
    assert plan["weights_bytes"] == _loaded_bytes(model)


def test_dummy_q4_k_m_mix(trained_model):
    """--load-format dummy --quantization gguf:Q4_K_M: llama.cpp's type mix on random weights (Q6_K for the v and
    down projections of layers 0, 3, 6, 7 of 8), planned to the byte, and it generates."""
    from quant_serve.engine.plan.memory import plan_memory
    from quant_serve.engine.sampling_params import SamplingParams
    from quant_serve.quant.layers.linear import QuantLinear
    from quant_serve.quant.layers.parts import PartsLinear
    from quant_serve.quant.layers.w8 import W8Linear
    engine = make_engine(trained_model, num_blocks=8, max_model_len=128, load_format="dummy",
                         quantization="gguf:Q4_K_M",
                         dtype="float16")
    layers = engine.model.model.layers
    w8 = [i for i, layer in enumerate(layers) if isinstance(layer.mlp.down_proj, W8Linear)]
    assert w8 == [0, 3, 6, 7]
    # q / k Q4_K beside a Q6_K v: two parts, each in its file's bits
    assert all(isinstance(layers[i].self_attn.qkv_proj, PartsLinear) == (i in w8) for i in range(8))
    q4, q6 = layers[0].self_attn.qkv_proj.parts
    assert isinstance(q4, QuantLinear) and q4.output_sizes == [512, 128] and isinstance(q6, W8Linear) and q6.q6k_planes
    assert isinstance(layers[1].mlp.gate_up_proj, QuantLinear) and layers[1].mlp.gate_up_proj.superscales is not None
    assert engine.quant_config.describe_paths() == (
        f"24 INT4 Q4_K (W4A16, two-level scales, 4.625 bits), 4 {MERGED}, 4 Q6_K (6-bit: W4A16 fragment layout, 7 "
        "bits, on CUDA fp16; else W8A16 kernels, planes, 6.5625 bits)")
    plan = plan_memory(trained_model, weights_dtype="float16", quantization="gguf:Q4_K_M")
    assert plan.weights_source == "gguf: Q4_K x 48, Q6_K x 8"
    assert plan.weights_bytes == _loaded_bytes(engine.model)         # the dummy holds what a file's layers hold
    out = engine.generate(["The"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_q5_k_m_mix(trained_model):
    """--load-format dummy --quantization gguf:Q5_K_M: Q5_K layers in their 5-bit planes, qkv with a Q6_K v in two
    parts (Q5_K q / k planes beside Q6_K v planes), planned to the byte, weights about N(0, 0.02), and it
    generates."""
    from quant_serve.engine.plan.memory import plan_memory
    from quant_serve.engine.sampling_params import SamplingParams
    from quant_serve.quant.layers.parts import PartsLinear
    from quant_serve.quant.layers.w8 import W8Linear
    engine = make_engine(trained_model, num_blocks=8, max_model_len=128, load_format="dummy",
                         quantization="gguf:Q5_K_M",
                         dtype="float16")
    layers = engine.model.model.layers
    q5, q6 = layers[0].self_attn.qkv_proj.parts
    assert isinstance(layers[0].self_attn.qkv_proj, PartsLinear) and q5.q5k_planes and q6.q6k_planes
    assert q5.output_sizes == [512, 128] and q5.qweight.shape == (320, 640) and q5.superscales.dtype == torch.int32
    gate_up = layers[1].mlp.gate_up_proj
    assert isinstance(gate_up, W8Linear) and gate_up.q5k_planes and gate_up.offsets is None
    w = gate_up.dequantized_weight()
    assert abs(float(w.mean())) < 2e-3 and 0.01 < float(w.std()) < 0.04
    assert engine.quant_config.describe_paths() == (
        f"4 {MERGED}, 24 {Q5K}, 4 Q6_K (6-bit: W4A16 fragment layout, 7 bits, on CUDA fp16; else W8A16 kernels, "
        "planes, 6.5625 bits)")
    plan = plan_memory(trained_model, weights_dtype="float16", quantization="gguf:Q5_K_M")
    assert plan.weights_source == "gguf: Q5_K x 48, Q6_K x 8"
    assert plan.weights_bytes == _loaded_bytes(engine.model)
    out = engine.generate(["The"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("mix,paths,head", [("Q8_0", "32 8-bit (W8A16)", gguf.GGMLQuantizationType.Q8_0),
                                             ("Q4_0", "32 INT4 (W4A16, float offsets)", gguf.GGMLQuantizationType.Q6_K)])
def test_dummy_plain_mixes(mix, paths, head, trained_model):
    """--load-format dummy --quantization gguf:Q8_0 / gguf:Q4_0: every linear in the file's type (an untied head in
    Q6_K for Q4_0, in Q8_0 for Q8_0, as llama.cpp writes them), planned to the byte, and it generates."""
    from quant_serve.engine.plan.memory import plan_memory
    from quant_serve.engine.sampling_params import SamplingParams
    from quant_serve.quant.formats.gguf.config import dummy_gguf_config
    type_of = dummy_gguf_config(mix.lower(), 8).type_of
    assert type_of("lm_head") == head and type_of("model.layers.7.mlp.down_proj") == getattr(
        gguf.GGMLQuantizationType, mix)
    engine = make_engine(trained_model, num_blocks=8, max_model_len=128, load_format="dummy",
                         quantization=f"gguf:{mix}",
                         dtype="float16")
    assert engine.quant_config.describe_paths() == paths
    plan = plan_memory(trained_model, weights_dtype="float16", quantization=f"gguf:{mix.lower()}")
    assert plan.weights_source == f"gguf: {mix} x 56"        # the tiny model ties its head to the embedding
    assert plan.weights_bytes == _loaded_bytes(engine.model)
    out = engine.generate(["The"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_llama_qk_permutation_is_undone(tmp_path):
    """A llama-architecture GGUF holds q / k rows in llama.cpp's order: loaded (F16 dense and Q8_0 codes), the
    model's logits are those of the safetensors model it was written from."""
    from transformers import LlamaConfig, LlamaForCausalLM
    src = tmp_path / "llama"
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256, bos_token_id=0,
                         eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(src)
    copy_tokenizer(src)
    ids = [5, 900, 17, 4000, 33, 250, 7, 1200, 64, 3]
    reference = make_engine(src, num_blocks=8, max_model_len=128).score(ids)
    f16 = write_gguf(src, tmp_path / "llama-f16.gguf", "F16", arch="llama")
    assert torch.equal(make_engine(f16, num_blocks=8, max_model_len=128).score(ids), reference)
    q8 = write_gguf(src, tmp_path / "llama-q8.gguf", "Q8_0", arch="llama")
    ours = make_engine(q8, num_blocks=8, max_model_len=128).model.model.layers[1].self_attn.qkv_proj
    original = make_engine(src, num_blocks=8, max_model_len=128).model.model.layers[1].self_attn.qkv_proj.weight
    # Q8_0 rounds each weight by at most half a step of max|block| / 127; a row out of place is off by the weights
    err = (ours.dequantized_weight() - original.float()).abs()
    assert float(err.max()) < float(original.abs().max()) / 200


def test_eval_names_gguf_files_and_type_mix(gguf_dir):
    """eval's report: a GGUF file hashes by its bytes; its format names the type mix and the layer paths."""
    from quant_serve.eval.metadata import model_hash
    from quant_serve.quant.formats.gguf.config import GGUFConfig
    assert model_hash(gguf_dir / "tiny-Q4_0.gguf") != model_hash(gguf_dir / "tiny-Q4_1.gguf")
    config = GGUFConfig("gguf", 4, 32, type_of=None, type_mix={"Q6_K": 4, "Q4_K": 45})
    config.layer_paths.update({"int4": 20, "w8": 12})
    assert config.describe() == "gguf (Q4_K x 45, Q6_K x 4; linear layers: 20 INT4, 12 W8)"


def test_nan_scale_is_refused(tmp_path, random_model):
    """A corrupt block scale (NaN) is named at load, as a safetensors checkpoint's NaN is."""
    from quant_serve.engine.load.gguf.loader import gguf_files, gguf_model_config, load_gguf_model, open_gguf
    path = write_gguf(random_model, tmp_path / "bad.gguf", "Q8_0")
    ckpt = open_gguf(gguf_files(path))
    t = ckpt.tensors["blk.2.ffn_up.weight"]
    offset = t.data_offset + 34 * 5                     # block 5's fp16 scale
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([np.nan], np.float16).tobytes())
    ckpt = open_gguf(gguf_files(path))                  # the file changed: read again
    with pytest.raises(ValueError, match="blk.2.ffn_up.weight scales in .*bad.gguf holds 1 NaN or Inf"):
        load_gguf_model(ckpt, gguf_model_config(ckpt), torch.float32, "cpu", show_progress=False)
