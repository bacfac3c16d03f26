"""Bit-exact conversions of every INT4 format into the internal layout, checked against each format's own dequant
formula (formats.md), written here independently in numpy with per-nibble shifts."""
import numpy as np
import pytest
import torch

from quant_serve.quant.formats import load_quant_config
from quant_serve.quant.layers.linear import QuantLinear

GROUP_SIZES = [32, 64, 128, -1]
PREFIX = "model.layers.0.mlp.down_proj"
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


# ---- the formats' formulas, numpy style ------------------------------------------------------------------

def nib(words, i):
    return (np.asarray(words).astype(np.int64) >> (4 * i)) & 0xF


def groups_of(k, gs, g_idx=None):
    return np.asarray(g_idx, dtype=np.int64) if g_idx is not None else np.arange(k) // (k if gs <= 0 else gs)


def awq_formula(t, k, n, gs):
    q, z = np.zeros((k, n), np.int64), np.zeros((t["qzeros"].shape[0], n), np.int64)
    for c in range(8):
        q[:, c::8] = nib(t["qweight"], AWQ_REVERSE[c])
        z[:, c::8] = nib(t["qzeros"], AWQ_REVERSE[c])
    gi = groups_of(k, gs)
    return ((q - z[gi]).astype(np.float32) * t["scales"].float().numpy()[gi]).T       # [N, K]


def gptq_formula(t, k, n, version):
    q, z = np.zeros((k, n), np.int64), np.zeros((t["qzeros"].shape[0], n), np.int64)
    for j in range(8):
        q[j::8, :] = nib(t["qweight"], j)
        z[:, j::8] = nib(t["qzeros"], j) + (1 if version == "gptq" else 0)
    gi = groups_of(k, 0, t["g_idx"])
    return ((q - z[gi]).astype(np.float32) * t["scales"].float().numpy()[gi]).T


def ct_formula(t, gs, sym):
    n, k = (int(v) for v in t["weight_shape"])
    u = np.zeros((n, t["weight_packed"].shape[1] * 8), np.int64)
    for j in range(8):
        u[:, j::8] = nib(t["weight_packed"], j)
    u = u[:, :k]
    gi = groups_of(k, gs, t["weight_g_idx"] if "weight_g_idx" in t else None)
    s = t["weight_scale"].float().numpy()[:, gi]                                     # [N, K]
    if sym:
        return (u - 8).astype(np.float32) * s
    zp = t["weight_zero_point"]
    uz = np.zeros((zp.shape[0] * 8, zp.shape[1]), np.int64)
    for c in range(8):
        uz[c::8, :] = nib(zp, c)
    return (u - uz[:n][:, gi]).astype(np.float32) * s


# ---- random raw checkpoint tensors -----------------------------------------------------------------------

def words(gen, shape, max_nibble=15):
    """int32 words whose 8 nibbles are uniform in 0..max_nibble."""
    nibbles = torch.randint(0, max_nibble + 1, (*shape, 8), generator=gen, dtype=torch.int64)
    w = (nibbles << (4 * torch.arange(8))).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def rand_scales(gen, shape, dtype=torch.float16):
    return (torch.rand(shape, generator=gen) * 0.02 + 1e-3).to(dtype)


def random_checkpoint(kind, k, n, gs, seed=0, act_order=False):
    """-> (quantization_config, raw tensors of one module, numpy formula result [N, K])."""
    gen = torch.Generator().manual_seed(seed)
    g = -(-k // (k if gs <= 0 else gs))
    if kind == "awq":
        t = {"qweight": words(gen, (k, n // 8)), "qzeros": words(gen, (g, n // 8)), "scales": rand_scales(gen, (g, n))}
        cfg = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"}
        return cfg, t, awq_formula(t, k, n, gs)
    if kind.startswith("gptq"):
        version, sym = ("gptq_v2" if "v2" in kind else "gptq"), kind.endswith("sym") and "asym" not in kind
        g_idx = torch.arange(k) // (k if gs <= 0 else gs)
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        if sym:
            qzeros = torch.full((g, n // 8), 0x77777777 if version == "gptq" else -2004318072, dtype=torch.int32)
        else:
            qzeros = words(gen, (g, n // 8), 14 if version == "gptq" else 15)
        t = {"qweight": words(gen, (k // 8, n)), "qzeros": qzeros, "scales": rand_scales(gen, (g, n)),
             "g_idx": g_idx.to(torch.int32)}
        cfg = {"quant_method": "gptq", "bits": 4, "group_size": gs, "sym": sym, "desc_act": act_order,
               "checkpoint_format": version}
        return cfg, t, gptq_formula(t, k, n, version)
    sym = kind == "ct_sym"
    t = {"weight_packed": words(gen, (n, k // 8)), "weight_scale": rand_scales(gen, (n, g), torch.bfloat16),
         "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        t["weight_zero_point"] = words(gen, (n // 8, g))
    if act_order:
        g_idx = torch.arange(k) // (k if gs <= 0 else gs)
        t["weight_g_idx"] = g_idx[torch.randperm(k, generator=gen)].to(torch.int32)
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group" if gs > 0 else "channel",
               "group_size": gs if gs > 0 else None}
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ["lm_head"]}
    return cfg, t, ct_formula(t, gs, sym)


def build_layer(cfg, modules: dict[str, dict], k, dtype=torch.float32, bias=False):
    """modules: prefix -> raw tensors. One QuantLinear over all of them (merged in dict order), loaded + finalized."""
    names = {f"{p}.{s}" for p, t in modules.items() for s in t}
    qc = load_quant_config({"quantization_config": cfg}, None, names)
    sizes = [(t["scales"].shape[1] if "scales" in t else t["weight_scale"].shape[0]) for t in modules.values()]
    layer = qc.make_linear(k, sizes, bias, dtype, "cpu", list(modules))
    for i, (p, t) in enumerate(modules.items()):
        layer.load_shard(i, t, p)
    layer.finalize()
    return layer


KINDS = ["awq", "gptq_v1_sym", "gptq_v1_asym", "gptq_v2_sym", "gptq_v2_asym", "ct_sym", "ct_asym"]


@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_random_words_bit_exact(kind, gs):
    k, n = 256, 48
    cfg, t, expected = random_checkpoint(kind, k, n, gs, seed=hash((kind, gs)) % 1000)
    layer = build_layer(cfg, {PREFIX: t}, k)
    assert isinstance(layer, QuantLinear)
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(expected))


@pytest.mark.parametrize("kind", ["gptq_v1_asym", "ct_sym"])
def test_last_group_partial(kind):
    k, n = 192, 16                                    # group 128 -> groups of 128 and 64
    cfg, t, expected = random_checkpoint(kind, k, n, 128, seed=3)
    assert torch.equal(build_layer(cfg, {PREFIX: t}, k).dequantized_weight(), torch.from_numpy(expected))


@pytest.mark.parametrize("gs", GROUP_SIZES)
@pytest.mark.parametrize("kind", ["gptq_v1_sym", "gptq_v2_asym", "ct_asym"])
def test_act_order_permuted_path_matches_g_idx_indexing(kind, gs):
    k, n = 256, 32
    cfg, t, expected = random_checkpoint(kind, k, n, gs, seed=11, act_order=True)
    g_idx = t.get("g_idx", t.get("weight_g_idx"))
    assert gs == -1 or not torch.equal(g_idx.long(), torch.sort(g_idx.long()).values)   # really non-monotone
    layer = build_layer(cfg, {PREFIX: t}, k)
    assert (layer.perm is not None) == (gs != -1)
    w = torch.from_numpy(expected)
    assert torch.equal(layer.dequantized_weight(), w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x.view(1, 5, k)), (x @ w.t()).view(1, 5, n), rtol=1e-5, atol=1e-5)


def test_scales_kept_in_model_dtype_or_upcast():
    cfg, t, expected = random_checkpoint("awq", 128, 16, 64)
    assert build_layer(cfg, {PREFIX: t}, 128, dtype=torch.float16).scales.dtype == torch.float16
    assert build_layer(cfg, {PREFIX: t}, 128, dtype=torch.bfloat16).scales.dtype == torch.float32
    cfg, t, expected = random_checkpoint("ct_sym", 128, 16, 64)                   # bf16 scales in an fp16 model
    layer = build_layer(cfg, {PREFIX: t}, 128, dtype=torch.float16)
    assert layer.scales.dtype == torch.float32
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(expected))


@pytest.mark.parametrize("act_order", [False, True])
def test_merged_shards_equal_separate_layers(act_order):
    k, sizes = 256, [64, 16, 16]
    prefixes = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    parts = [random_checkpoint("gptq_v2_asym", k, n, 64, seed=20 + i, act_order=act_order)
             for i, n in enumerate(sizes)]
    # One sym shard (qzeros all 8 -> None internally) merged with asym ones exercises the explicit-eights path.
    parts[1][1]["qzeros"] = torch.full_like(parts[1][1]["qzeros"], -2004318072)
    for _, t, _ in parts:
        t["bias"] = torch.randn(t["scales"].shape[1]).half()
    cfg = parts[0][0]
    merged = build_layer(cfg, {p: t for p, (_, t, _) in zip(prefixes, parts)}, k, bias=True)
    separate = [build_layer(cfg, {p: t}, k, bias=True) for p, (_, t, _) in zip(prefixes, parts)]
    assert (merged.parts is not None) == act_order            # different perms stay separate sub-layers
    assert torch.equal(merged.dequantized_weight(), torch.cat([s.dequantized_weight() for s in separate]))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(merged(x), torch.cat([s(x) for s in separate], dim=-1), rtol=1e-5, atol=1e-5)


def test_merged_shards_sharing_one_perm_concatenate():
    k = 128
    _, a, _ = random_checkpoint("gptq_v1_sym", k, 16, 32, seed=1, act_order=True)
    cfg, b, _ = random_checkpoint("gptq_v1_sym", k, 24, 32, seed=2, act_order=True)
    b["g_idx"] = a["g_idx"].clone()
    merged = build_layer(cfg, {"m.layers.0.gate_proj": a, "m.layers.0.up_proj": b}, k)
    assert merged.parts is None and merged.perm is not None and merged.qzeros is None
    expected = torch.cat([torch.from_numpy(gptq_formula(t, k, t["scales"].shape[1], "gptq")) for t in (a, b)])
    assert torch.equal(merged.dequantized_weight(), expected)


def test_dummy_init_runs():
    cfg, t, _ = random_checkpoint("awq", 128, 16, 64)
    layer = build_layer(cfg, {PREFIX: t}, 128)
    layer.init_dummy(torch.Generator().manual_seed(0))
    y = layer(torch.randn(2, 128))
    assert y.shape == (2, 16) and torch.isfinite(y).all()


@pytest.mark.parametrize("quant,int4_head", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "lm_head": True}, True),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, False),
    ("ct-no-ignore", True), ("ct-ignore-head", False)])
def test_config_alone_decides_the_head_of_a_dummy_model(quant, int4_head, tmp_path):
    """--load-format dummy has no header to read: GPTQ's `lm_head` flag and compressed-tensors' `ignore` decide
    whether the head is INT4, as they do for the memory plan (engine/plan/memory.py) of the same config."""
    from quant_serve.engine.plan.memory import plan_memory
    from helpers import make_engine
    from quant_serve.quant.formats import ct_quantization_config
    from quant_serve.engine.load.demo import DEMO_MODEL_DIR
    from quant_serve.quant.layers.dense import DenseLinear
    if isinstance(quant, str):
        quant = ct_quantization_config(32, sym=False, ignore=[] if quant == "ct-no-ignore" else ["lm_head"])
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
           "torch_dtype": "float16", "quantization_config": quant}
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    engine = make_engine(tmp_path, load_format="dummy", tokenizer=str(DEMO_MODEL_DIR), num_blocks=16)
    assert isinstance(engine.model.lm_head, QuantLinear if int4_head else DenseLinear)
    dense_head = dict(quant, lm_head=False) if "bits" in quant else dict(quant, ignore=["lm_head"])
    saved = (plan_memory(dict(cfg, quantization_config=dense_head), max_model_len=128).weights_bytes
             - plan_memory(cfg, max_model_len=128).weights_bytes)
    # fp16 [1024, 64] against 4-bit codes, per-32 fp16 scales, packed zeros and GPTQ's g_idx [64] int32 or
    # compressed-tensors' weight_shape [2] int64
    int4 = 1024 * 64 // 2 + 2 * 1024 * 2 + 2 * 1024 // 2 + (64 * 4 if "bits" in quant else 16)
    assert saved == (1024 * 64 * 2 - int4 if int4_head else 0)
