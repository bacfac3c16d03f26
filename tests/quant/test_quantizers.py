"""Quantizers end to end on a small random Llama (MHA, untied head, outlier channels): every format written by our
quantizers reads back bit-exactly, act-order checkpoints run the same through the permuted and the g_idx path,
interrupted runs leave nothing behind, AWQ and GPTQ never lose to RTN; plus calibration input and the CLI."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from helpers import bench_script, make_engine
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.kernels.matmul.reference import unpack_int4_cols, unpack_int4_rows
from quant_serve.quant import quantize as quantize_mod
from quant_serve.engine.models.dense_calib import dense_logits
from quant_serve.quant.calib import calib_tokens, read_calib_file
from quant_serve.quant.quantize import QuantizeConfig, quantize_model
from quant_serve.quant.gptq import GPTQSettings
from quant_serve.quant.rtn import dequantize_codes
from quant_serve.server.cli.main import main as cli
from quant_serve.server.cli.quantize import load_source

dense_weights = bench_script("quant_quality").dense_weights      # any checkpoint -> fp32 weights, through our readers

H, I, LAYERS, HEADS, VOCAB, GS = 256, 512, 2, 4, 512, 64
OUTLIERS = [3, 77, 200]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """Random Llama whose residual stream has a few large channels and whose weights vary per input channel,
    like trained models (and unlike i.i.d. noise, where every quantizer ties)."""
    d = tmp_path_factory.mktemp("random-llama")
    gen = torch.Generator().manual_seed(0)

    def lin(n, k):
        col = torch.exp(0.5 * torch.randn(k, generator=gen))                      # per-input-channel spread
        return torch.randn(n, k, generator=gen) * col / math.sqrt(k)

    t = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=gen), "model.norm.weight": torch.ones(H),
         "lm_head.weight": torch.randn(VOCAB, H, generator=gen) * 2 / math.sqrt(H)}
    t["model.embed_tokens.weight"][:, OUTLIERS] *= 8
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"] = 1 + 0.1 * torch.randn(H, generator=gen)
        for name, (n, k) in {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H), "self_attn.v_proj": (H, H),
                             "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
                             "mlp.down_proj": (H, I)}.items():
            t[p + name + ".weight"] = lin(n, k)
        t[p + "mlp.up_proj.weight"][:8] *= 4                                          # outliers into down_proj
    save_file({k: v.half().contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float16", "bos_token_id": 0,
        "eos_token_id": 1}))
    return d


@pytest.fixture(scope="module")
def source(llama_dir):
    return load_source(llama_dir)


def tokens(seed, n=16, length=128):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def quantize(source, out, sink=None, **kw):
    cfg = QuantizeConfig(group_size=GS, **kw)
    return quantize_model(source, tokens(1), cfg, out, show_progress=False, results_sink=sink)


# ---- formats: our writers + our readers, bit for bit ------------------------------------------------------

CASES = {  # format -> quantizer settings that exercise it
    "awq": dict(method="awq"),
    "gptq": dict(method="gptq", sym=True, gptq=GPTQSettings(act_order=True)),
    "gptq_v2": dict(method="gptq", sym=False, gptq=GPTQSettings(act_order=True)),
    "compressed-tensors": dict(method="gptq", sym=True, gptq=GPTQSettings(act_order=True, static_groups=True)),
    "compressed-tensors-asym": dict(method="rtn", sym=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_format_reads_back_bit_exactly(case, source, tmp_path):
    fmt = case.removesuffix("-asym")
    sink = {}
    out = quantize(source, tmp_path / case, sink, format=fmt, **CASES[case])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == ("compressed-tensors" if fmt == "compressed-tensors" else fmt[:4].rstrip("_"))
    weights = dense_weights(out)
    assert len(sink) == 7 * LAYERS
    for prefix, res in sink.items():
        expected = dequantize_codes(res.q, res.scales.half().float(), res.zeros, GS, res.g_idx)
        assert torch.equal(weights[prefix + ".weight"], expected), prefix
    if fmt.startswith("gptq"):                                # act-order: a real permutation was written
        res = sink["model.layers.0.mlp.down_proj"]
        assert res.g_idx is not None and not torch.equal(res.g_idx.long(), torch.arange(I) // GS)
        assert config["desc_act"] is True


def test_rtn_codes_are_the_formula(source, tmp_path):
    from quant_serve.quant.rtn import quantize_rtn
    sink = {}
    quantize(source, tmp_path / "rtn", sink, method="rtn")
    w = source.read("model.layers.1.mlp.down_proj.weight").float()
    q, s, z = quantize_rtn(w, 4, GS, sym=False, scale_dtype=torch.float16)
    res = sink["model.layers.1.mlp.down_proj"]
    assert torch.equal(res.q, q) and torch.equal(res.scales, s) and torch.equal(res.zeros, z)


def test_act_order_permuted_path_equals_g_idx_indexing(source, llama_dir, tmp_path):
    out = quantize(source, tmp_path / "ao", method="gptq", sym=False, gptq=GPTQSettings(act_order=True))
    engine = make_engine(out, tokenizer=str(DEMO_MODEL_DIR), num_blocks=64)
    assert engine.model.model.layers[0].mlp.down_proj.perm is not None      # the kernel path gathers x[:, perm]
    ids = tokens(7, 1, 96)[0]
    permuted = engine.score(ids.tolist())                                      # [96, V]
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        raw = {k: f.get_tensor(k) for k in f.keys()}
    weights = {k: v.float() for k, v in raw.items() if v.is_floating_point() and not k.endswith(("scales", "bias"))}
    for key in [k for k in raw if k.endswith(".qweight")]:
        p = key.removesuffix(".qweight")
        q = unpack_int4_rows(raw[p + ".qweight"]).t()                         # [N, K]
        z = unpack_int4_cols(raw[p + ".qzeros"])                              # v2: real zeros
        weights[p + ".weight"] = dequantize_codes(q, raw[p + ".scales"].float(), z, GS, raw[p + ".g_idx"])
    indexed = dense_logits(source.model.config, weights, ids[None])[0]
    torch.testing.assert_close(permuted, indexed, rtol=1e-4, atol=1e-4)


def test_awq_folding_keeps_the_fp_block_exact(source):
    """AWQ's smoothing scales are an identity in FP: the folded norms / v rows / up rows undo the scaled inputs
    (the random Llama is MHA, so the v -> o fold runs too)."""
    from quant_serve.quant.awq import AWQSettings, awq_block
    w = {k.removeprefix("model.layers.0."): source.read(k).float() for k in source.tensor_names
         if k.startswith("model.layers.0.")}
    before = dict(w)
    x = source.read("model.embed_tokens.weight")[tokens(3, 4, 64)].float()
    block = source.model.block(0, 64, "cpu")
    awq_block(w, x, block, GS, False, AWQSettings())
    for name in ("input_layernorm", "post_attention_layernorm", "self_attn.v_proj", "mlp.up_proj"):
        assert not torch.equal(w[name + ".weight"], before[name + ".weight"]), name      # something was folded
    torch.testing.assert_close(block.forward(w, x), block.forward(before, x), rtol=1e-4, atol=1e-4)


# ---- atomic output -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_run_leaves_nothing(error, source, tmp_path, monkeypatch):
    real, calls = quantize_mod.quantize_block, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise error("interrupted in block 1")
        return real(*args, **kw)

    monkeypatch.setattr(quantize_mod, "quantize_block", failing)
    with pytest.raises(error):
        quantize(source, tmp_path / "out", method="gptq")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []                    # no OUT_DIR, no temporary directory


def test_refuses_to_overwrite_unless_asked(source, tmp_path):
    out = tmp_path / "out"
    quantize(source, out, method="rtn")
    with pytest.raises(ValueError, match="--overwrite"):
        quantize(source, out, method="rtn")
    before = (out / "model.safetensors").stat().st_ino
    quantize_model(source, None, QuantizeConfig(method="rtn", group_size=GS), out, overwrite=True,
                   show_progress=False)
    assert (out / "model.safetensors").stat().st_ino != before          # replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_format_refusals():
    with pytest.raises(ValueError, match="gptq_v2"):
        QuantizeConfig(method="gptq", sym=False, format="gptq").resolved()
    with pytest.raises(ValueError, match="act-order"):
        QuantizeConfig(method="gptq", format="awq", gptq=GPTQSettings(act_order=True)).resolved()
    assert QuantizeConfig(method="gptq").resolved() == (True, "gptq")
    assert QuantizeConfig(method="gptq", sym=False).resolved() == (False, "gptq_v2")
    assert QuantizeConfig(method="awq").resolved() == (False, "awq")


# ---- never worse than RTN on a model it was not tuned on ---------------------------------------------------

@pytest.mark.parametrize("fmt,sym", [("gptq", True), ("compressed-tensors", False)])
def test_quantized_lm_head_writes_loads_and_scores(fmt, sym, source, tmp_path):
    """--lm-head: the head is written as INT4 (GPTQ `lm_head: true`; compressed-tensors with nothing ignored),
    loads as a QuantLinear, and the engine's logits are those of the dequantized head: exactly the dense head's
    logits computed with the round-to-nearest weights."""
    from quant_serve.quant.layers.dense import DenseLinear
    from quant_serve.quant.layers.linear import QuantLinear
    sink = {}
    with_head = quantize(source, tmp_path / "head", sink, method="rtn", sym=sym, format=fmt, lm_head=True)
    without = quantize(source, tmp_path / "dense", method="rtn", sym=sym, format=fmt)
    config = json.loads((with_head / "config.json").read_text())["quantization_config"]
    assert config.get("lm_head") is True if fmt == "gptq" else config["ignore"] == []
    weights = dense_weights(with_head)
    res = sink["lm_head"]
    head = dequantize_codes(res.q, res.scales.half().float(), res.zeros, GS, None)
    assert torch.equal(weights["lm_head.weight"], head)
    quant_engine, dense_engine = (make_engine(d, tokenizer=str(DEMO_MODEL_DIR), num_blocks=64)
                                  for d in (with_head, without))
    assert isinstance(quant_engine.model.lm_head, QuantLinear)
    assert isinstance(dense_engine.model.lm_head, DenseLinear)
    ids = tokens(5, n=1, length=48)[0].tolist()
    dense_engine.model.lm_head.weight.data.copy_(head)          # the same head, dequantized
    torch.testing.assert_close(quant_engine.score(ids), dense_engine.score(ids), atol=2e-4, rtol=2e-4)
    with pytest.raises(ValueError, match="AutoAWQ's format keeps lm_head in FP16"):
        QuantizeConfig(method="rtn", format="awq", lm_head=True).resolved()


def test_gptq_head_beats_rtn_head_on_held_out_hidden_states(source, tmp_path):
    """--method gptq --lm-head: GPTQ on the calibration text's last hidden states; its head's output error on
    other text is below round-to-nearest's."""
    heads = {}
    for method in ("rtn", "gptq"):
        sink = {}
        quantize(source, tmp_path / method, sink, method=method, sym=True, format="gptq", lm_head=True)
        heads[method] = sink["lm_head"].dequantize(GS)
    model, read = source.model, source.read
    ids = tokens(7, n=4)
    x = model.embed(ids, "cpu")
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        x = model.block(i, ids.shape[1], "cpu").forward(
            {n[len(p):]: read(n).float() for n in source.tensor_names if n.startswith(p)}, x)
    h = model.final_norm(x).reshape(-1, H)
    w = read("lm_head.weight").float()
    err = {m: float((h @ (q - w).t()).norm() / (h @ w.t()).norm()) for m, q in heads.items()}
    assert err["gptq"] < 0.9 * err["rtn"], err


def test_awq_and_gptq_beat_rtn_on_random_llama(source, llama_dir, tmp_path):
    ids = tokens(99, 8, 128)
    ref = torch.log_softmax(dense_logits(source.model.config, dense_weights(llama_dir), ids), -1)

    def kld(out):
        lp = torch.log_softmax(dense_logits(source.model.config, dense_weights(out), ids), -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    got = {m: kld(quantize(source, tmp_path / m, method=m, sym=False)) for m in ("rtn", "awq", "gptq")}
    assert got["awq"] < got["rtn"] and got["gptq"] < got["rtn"], got


# ---- calibration input and the CLI -------------------------------------------------------------------------

def test_calibration_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n\nthree\n\n\nfour")
    assert read_calib_file(tmp_path / "a.txt") == ["one\ntwo", "three", "four"]
    (tmp_path / "b.txt").write_text("x\n\ny<|endoftext|>z")
    assert read_calib_file(tmp_path / "b.txt") == ["x\n\ny", "z"]
    (tmp_path / "c.jsonl").write_text('{"text": "p"}\n\n{"text": "q", "id": 2}\n')
    assert read_calib_file(tmp_path / "c.jsonl") == ["p", "q"]
    (tmp_path / "d.jsonl").write_text('{"body": "p"}\n')
    with pytest.raises(ValueError, match="text"):
        read_calib_file(tmp_path / "d.jsonl")
    ids = calib_tokens(["abcd"] * 10, lambda s: list(range(len(s))), 3, 5, separator=[9])
    assert ids.shape == (3, 5) and ids[0].tolist() == [0, 1, 2, 3, 9]
    with pytest.raises(ValueError, match="fewer than one window"):
        calib_tokens(["ab"], lambda s: [1, 2], 4, 512)


def test_cli_quantize_then_generate(tmp_path, capsys, random_model):
    out = tmp_path / "tiny-rtn"
    assert cli(["quantize", str(random_model), str(out), "--method", "rtn", "--device", "cpu"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 128,
                                             "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    capsys.readouterr()
    assert cli(["generate", "--model", str(out), "--prompt", "The Python", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli(["quantize", str(random_model), str(tmp_path / "y"), "--method", "gptq", "--asym",
                "--format", "gptq"]) == 2
    assert "gptq_v2" in capsys.readouterr().err and not (tmp_path / "y").exists()
