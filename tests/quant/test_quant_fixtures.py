"""Real checkpoints: every quantized module of tiny-qwen2-awq (AutoAWQ 0.2.9 gemm g128) and tiny-qwen2-w4a16-ct
(llm-compressor pack-quantized sym g128) through our readers.

1. Exactness: the dequantized weights equal the formats.md formula, computed here element by element in plain
   Python ints on a few rows of every module, and vectorized (AutoAWQ-style shifts) on all of them.
2. Bit order: the dequantized weights are close to the FP16 model's (a wrong interleave or nibble order gives a
   relative error above 1.0; we assert the opposite case too). CT (GPTQ-calibrated, no folding) is compared directly.
   AWQ folded its smoothing scales s[k] into the previous op, so W_awq[:, k] ~ W_fp16[:, k] * s[k]: for q/k/v/gate
   we divide by the exact s recovered from the norms (norm_fp16 / norm_awq); for every module we also divide by a
   per-input-channel s fitted by least squares (it absorbs up/down's folding, and cannot undo a permutation of
   output channels, which is what a wrong AWQ interleave is).
The checkpoints are the third parties' own (../shared), which no tool of ours can stand in for.
"""
import glob
import json

import pytest
import torch
from safetensors import safe_open

from quant_serve.quant.formats import load_quant_config
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear

MODULES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]
PREV_NORM = {"self_attn.q_proj": "input_layernorm", "self_attn.k_proj": "input_layernorm",
             "self_attn.v_proj": "input_layernorm", "mlp.gate_proj": "post_attention_layernorm"}
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def read_all(pattern: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(glob.glob(str(pattern))):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def fp16(tiny_trained):
    return read_all(tiny_trained / "*.safetensors")


def load_model(model_dir):
    """-> (tensors, {prefix: QuantLinear}) for every Linear of the 8 layers, each loaded like the engine does."""
    tensors = read_all(model_dir / "*.safetensors")
    qc = load_quant_config(json.loads((model_dir / "config.json").read_text()), model_dir, set(tensors))
    layers = {}
    for i in range(8):
        for mod in MODULES:
            p = f"model.layers.{i}.{mod}"
            shape = tensors[p + ".weight_shape"].tolist() if p + ".weight_shape" in tensors else None
            n, k = shape or (tensors[p + ".scales"].shape[1], tensors[p + ".qweight"].shape[0])
            layer = qc.make_linear(k, [n], p + ".bias" in tensors, torch.float32, "cpu", [p])
            assert isinstance(layer, QuantLinear), p
            layer.load_shard(0, {s[len(p) + 1:]: t for s, t in tensors.items() if s.startswith(p + ".")}, p)
            layer.finalize()
            layers[p] = layer
    assert isinstance(qc.make_linear(512, [8192], False, torch.float32, "cpu", ["lm_head"]), DenseLinear)
    return qc, tensors, layers


@pytest.fixture(scope="module")
def awq(tiny_awq_autoawq):
    return load_model(tiny_awq_autoawq)


@pytest.fixture(scope="module")
def ct(tiny_ct):
    return load_model(tiny_ct)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def fitted(w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """w / s with s[k] the least-squares per-input-channel scale taking ref to w."""
    return w / ((w * ref).sum(0) / (ref * ref).sum(0))


# ---- exactness -------------------------------------------------------------------------------------------

def awq_element_rows(t: dict, p: str, rows: list[int], group: int) -> torch.Tensor:
    """formats.md section 1, one element at a time: nibble AWQ_REVERSE[n % 8] of word qweight[k, n // 8]."""
    k_in = t[p + ".qweight"].shape[0]
    out = []
    for n in rows:
        words = t[p + ".qweight"][:, n // 8].tolist()
        zwords = t[p + ".qzeros"][:, n // 8].tolist()
        scales = t[p + ".scales"][:, n].float().tolist()
        shift = 4 * AWQ_REVERSE[n % 8]
        out.append([(((words[k] & 0xFFFFFFFF) >> shift & 0xF) - ((zwords[k // group] & 0xFFFFFFFF) >> shift & 0xF))
                    * scales[k // group] for k in range(k_in)])
    return torch.tensor(out, dtype=torch.float64).float()


def ct_element_rows(t: dict, p: str, rows: list[int], group: int) -> torch.Tensor:
    """formats.md section 3 (sym): nibble k % 8 of word weight_packed[n, k // 8], minus the +8 offset."""
    _, k_in = t[p + ".weight_shape"].tolist()
    out = []
    for n in rows:
        words = t[p + ".weight_packed"][n].tolist()
        scales = t[p + ".weight_scale"][n].float().tolist()
        out.append([(((words[k // 8] & 0xFFFFFFFF) >> (4 * (k % 8)) & 0xF) - 8) * scales[k // group]
                    for k in range(k_in)])
    return torch.tensor(out, dtype=torch.float64).float()


def awq_vectorized(t: dict, p: str, group: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm, restated: shift every word by all 8 nibble offsets, undo the interleave."""
    shifts = torch.arange(0, 32, 4)
    order = torch.arange(t[p + ".scales"].shape[1]).view(-1, 8)[:, AWQ_REVERSE].reshape(-1)
    iw = ((t[p + ".qweight"][:, :, None] >> shifts) & 15).flatten(1)[:, order]
    iz = ((t[p + ".qzeros"][:, :, None] >> shifts) & 15).flatten(1)[:, order]
    w = (iw - iz.repeat_interleave(group, 0)).float() * t[p + ".scales"].float().repeat_interleave(group, 0)
    return w.t()


def test_awq_fixture_is_bit_exact(awq):
    qc, t, layers = awq
    assert qc.describe() == "awq gemm, 4-bit, group 128, zero point"
    for p, layer in layers.items():
        w = layer.dequantized_weight()
        rows = [0, 7, 13, w.shape[0] - 1]
        assert torch.equal(w[rows], awq_element_rows(t, p, rows, 128)), p
        assert torch.equal(w, awq_vectorized(t, p, 128)), p


def test_ct_fixture_is_bit_exact(ct):
    qc, t, layers = ct
    assert qc.describe() == "compressed-tensors pack-quantized, 4-bit, group 128, symmetric"
    for p, layer in layers.items():
        assert layer.qzeros is None and layer.perm is None, p
        w = layer.dequantized_weight()
        rows = [0, 5, w.shape[0] - 1]
        assert torch.equal(w[rows], ct_element_rows(t, p, rows, 128)), p
        s = t[p + ".weight_scale"].float().repeat_interleave(128, 1)
        packed = t[p + ".weight_packed"]
        u = torch.stack([(packed >> (4 * j)) & 15 for j in range(8)], dim=-1).flatten(1)
        assert torch.equal(w, (u - 8).float() * s), p


# ---- bit order: close to the FP16 model ------------------------------------------------------------------

def test_ct_fixture_close_to_fp16(ct, fp16):
    _, _, layers = ct
    errors = {p: rel(layer.dequantized_weight(), fp16[p + ".weight"].float()) for p, layer in layers.items()}
    assert max(errors.values()) < 0.2, max(errors.items(), key=lambda e: e[1])     # GPTQ trades weight error
    assert sum(errors.values()) / len(errors) < 0.15                               # for output error
    p = "model.layers.0.mlp.gate_proj"
    wrong = layers[p].dequantized_weight().reshape(1408, 64, 8).flip(-1).reshape(1408, 512)   # reversed nibbles
    assert rel(wrong, fp16[p + ".weight"].float()) > 1.0


def test_awq_fixture_close_to_fp16(awq, fp16):
    _, t, layers = awq
    assert torch.equal(t["model.embed_tokens.weight"], fp16["model.embed_tokens.weight"])
    for p, layer in layers.items():
        w, ref = layer.dequantized_weight(), fp16[p + ".weight"].float()
        assert rel(fitted(w, ref), ref) < 0.15, p
        layer_prefix, mod = p.split(".self_attn.")[0].split(".mlp.")[0], p.split(".", 3)[3]
        if mod in PREV_NORM:                          # exact smoothing scales, recovered from the folded norm
            norm = f"{layer_prefix}.{PREV_NORM[mod]}.weight"
            s = fp16[norm].float() / t[norm].float()
            assert rel(w / s, ref) < 0.2, p
        if mod == "self_attn.o_proj":                 # GQA: v_proj and o_proj shapes differ, AutoAWQ folds nothing
            assert rel(w, ref) < 0.15, p
    p = "model.layers.0.mlp.gate_proj"
    w, ref = layers[p].dequantized_weight(), fp16[p + ".weight"].float()
    wrong = w.view(-1, 8, 1, 512)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(1408, 512)           # interleave not undone
    assert rel(fitted(wrong, ref), ref) > 1.0


def test_fixture_merged_qkv_equals_separate(awq, ct):
    for qc, t, layers in (awq[0], awq[1], awq[2]), (ct[0], ct[1], ct[2]):
        prefixes = [f"model.layers.2.self_attn.{x}_proj" for x in "qkv"]
        merged = qc.make_linear(512, [512, 128, 128], True, torch.float32, "cpu", prefixes)
        for i, p in enumerate(prefixes):
            merged.load_shard(i, {s[len(p) + 1:]: v for s, v in t.items() if s.startswith(p + ".")}, p)
        merged.finalize()
        separate = [layers[p] for p in prefixes]
        assert torch.equal(merged.dequantized_weight(), torch.cat([s.dequantized_weight() for s in separate]))
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(merged(x), torch.cat([s(x) for s in separate], -1), rtol=1e-5, atol=1e-5)
