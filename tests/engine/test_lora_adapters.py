"""LoRA adapters below the engine: the PEFT reader's refusals (engine/lora/adapter.py), its scaling rules,
LoRALinear over an INT4 and a merged dense base (quant/layers/lora.py), and the prefix cache keyed by adapter
(engine/core/block_manager.py, exact block ids)."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TESTS
from quant_serve.engine.config import LoRAConfig
from quant_serve.engine.core.block_manager import BlockManager
from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.lora.adapter import load_adapter
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.quant.layers.dense import DenseLinear
from quant_serve.quant.layers.linear import QuantLinear
from quant_serve.quant.layers.lora import LoRABatch, LoRALinear
from helpers import make_engine

LORA = TESTS / "data" / "lora"
Q4 = "base_model.model.model.layers.4.self_attn.q_proj"


@pytest.fixture(scope="module")
def engine(trained_model):
    return make_engine(trained_model, num_blocks=64,
                       lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8))


def _broken(tmp_path, edit_tensors=None, edit_config=None):
    """A copy of the `upper` adapter with its tensors or config edited."""
    out = tmp_path / "broken"
    shutil.copytree(LORA / "upper", out)
    if edit_tensors:
        tensors = load_file(str(out / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    if edit_config:
        config = json.loads((out / "adapter_config.json").read_text())
        edit_config(config)
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _shapes(engine):
    return {k: (layer.in_features, layer.output_sizes) for k, layer in engine.lora.layers.items()}


def test_scaling_alpha_over_r_and_rslora(engine):
    upper = load_adapter("upper", LORA / "upper", 8, False, _shapes(engine))
    unsure = load_adapter("unsure", LORA / "unsure", 8, False, _shapes(engine))
    assert upper.modules["model.layers.4.self_attn.qkv_proj"].keys() == {0, 2}          # q and v of qkv
    assert upper.modules["model.layers.4.mlp.gate_up_proj"].keys() == {0}               # gate of gate_up
    assert "model.layers.3.self_attn.qkv_proj" not in upper.modules                    # layers 4-7 only
    assert upper.modules["model.layers.4.self_attn.qkv_proj"][0][2] == 16 / 8
    assert unsure.modules["model.layers.5.mlp.gate_up_proj"][1][2] == pytest.approx(8 / math.sqrt(8))
    assert set(unsure.modules["model.layers.5.self_attn.qkv_proj"]) == {1}               # k only


def test_rank_above_max_lora_rank_is_refused(engine):
    with pytest.raises(ValueError, match=r"LoRA adapter 'upper': tensor base_model.model.model.layers.4.mlp.down_proj."
                                         r"lora_A.weight has rank 8, above --max-lora-rank 4"):
        load_adapter("upper", LORA / "upper", 4, False, _shapes(engine))


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.update({f"{Q4}.lora_B.weight": t[f"{Q4}.lora_B.weight"][:100]}),
     rf"tensor {Q4}.lora_B.weight has shape \(100, 8\), expected \(512, 8\)"),
    (lambda t: t.update({f"{Q4}.lora_A.weight": t[f"{Q4}.lora_A.weight"][:, :64]}),
     rf"tensor {Q4}.lora_A.weight has shape \(8, 64\), expected \(r, 512\)"),
    (lambda t: t.update({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 8192)}),
     r"tensor base_model.model.model.embed_tokens.lora_A.weight is not a LoRA A/B of a decoder layer"),
    (lambda t: t.update({"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(8, 512)}),
     r"targets mlp.fc1, which this model cannot take"),
    (lambda t: t.update({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 512)}),
     r"targets mlp.q_proj"),
    (lambda t: t.update({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 512)}),
     r"is for layer 9, which the model does not have"),
    (lambda t: t.pop(f"{Q4}.lora_B.weight"), rf"tensor {Q4}.lora_A.weight has no lora_B partner"),
    (lambda t: t.update({f"{Q4}.lora_A.weight": t[f"{Q4}.lora_A.weight"].to(torch.int32)}),
     rf"tensor {Q4}.lora_A.weight has dtype torch.int32, expected float"),
])
def test_adapters_that_do_not_fit_are_refused_naming_the_tensor(engine, tmp_path, edit, message):
    path = _broken(tmp_path, edit_tensors=edit)
    with pytest.raises(ValueError, match=r"LoRA adapter 'bad': .*" + message):
        engine.load_lora_adapter("bad", str(path))
    assert "bad" not in engine.lora.adapters and engine.lora._slots == [None, None]     # nothing half-loaded


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(use_dora=True), r"use_dora=True is not supported"),
    (lambda c: c.update(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\] is not supported"),
    (lambda c: c.update(bias="all"), r"bias='all' is not supported"),
    (lambda c: c.update(peft_type="IA3"), r"peft_type IA3 is not LORA"),
    (lambda c: c.update(rank_pattern={"q_proj": 4}), rf"tensor {Q4}.lora_A.weight has rank 8, but its config says 4"),
])
def test_configs_we_cannot_serve_are_refused(engine, tmp_path, edit, message):
    with pytest.raises(ValueError, match=r"LoRA adapter 'bad': " + message):
        engine.load_lora_adapter("bad", str(_broken(tmp_path, edit_config=edit)))


def test_missing_files_are_refused(engine, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA adapter 'x': .* is not a directory"):
        engine.load_lora_adapter("x", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"LoRA adapter 'x': no adapter_config.json in"):
        engine.load_lora_adapter("x", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8}))
    with pytest.raises(ValueError, match=r"LoRA adapter 'x': no adapter_model.safetensors in"):
        engine.load_lora_adapter("x", str(tmp_path))


def _mixed_rows_check(base, in_features):
    """LoRALinear(base) on rows of slots [0, -1, 1, 0]: each row is base(x) + its own adapter's delta."""
    batch = LoRABatch()
    layer = LoRALinear(base, max_loras=2, max_rank=8, batch=batch, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    sizes = base.output_sizes
    adapters = []
    for slot, rank in ((0, 8), (1, 3)):
        parts = [(torch.randn(rank, in_features, generator=g), torch.randn(n, rank, generator=g), 0.5 + slot)
                 if i != 1 else None for i, n in enumerate(sizes)]          # the second part left alone
        layer.set_slot(slot, parts)
        adapters.append(parts)
    x = torch.randn(4, in_features, generator=g)
    slots = [0, -1, 1, 0]
    want = base(x).clone()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        deltas = [torch.zeros(n) if p is None else p[2] * (x[row] @ p[0].t()) @ p[1].t()
                  for p, n in zip(adapters[slot], sizes)]
        want[row] += torch.cat(deltas)
    assert torch.equal(layer(x), base(x))                 # no adapter in the step: the base alone, bit for bit
    batch.slots = torch.tensor(slots, dtype=torch.int32)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(layer(x)[1], base(x)[1])


def test_lora_linear_over_an_int4_layer():
    weight = torch.randn(3 * 32, 64) * 0.05
    _mixed_rows_check(_int4(weight), 64)


def _int4(weight):
    layer = QuantLinear.round_to_nearest(weight, 32, torch.float32, "cpu")
    layer.output_sizes = [32, 32, 32]          # read as a merged q | k | v layer of three parts
    return layer


def test_lora_linear_over_a_merged_dense_layer():
    base = DenseLinear(48, [40, 24, 24], False, torch.float32)
    base.weight.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    _mixed_rows_check(base, 48)


def test_prefix_cache_keys_blocks_by_adapter():
    """Two adapters never share K/V: the same tokens hit only the blocks written under the same adapter."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(100, 110))                        # 10 tokens: two full blocks and a partial one

    def run(rid, lora_id):
        seq = Sequence(rid, tokens, SamplingParams(), lora_id=lora_id)
        hit = bm.get_computed_blocks(seq)
        assert bm.allocate_slots(seq, len(tokens) - 4 * len(hit), hit)
        seq.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(seq)
        return seq, hit

    base, hit = run("base", 0)
    assert hit == [] and base.block_table == [0, 1, 2]
    a1, hit = run("a1", 1)
    assert hit == [] and a1.block_table == [3, 4, 5]      # adapter 1 does not hit the base's blocks
    a2, hit = run("a2", 2)
    assert hit == [] and a2.block_table == [6, 7, 8]
    again, hit = run("a1-again", 1)
    assert hit == [3, 4] and again.block_table == [3, 4, 9]
    base2, hit = run("base-again", 0)
    assert hit == [0, 1] and base2.block_table == [0, 1, 10]
    for seq in (base, a1, a2, again, base2):
        bm.free(seq)
    assert bm.num_free_blocks == 16


def test_engine_prefix_cache_hits_only_under_the_same_adapter(trained_model):
    engine = make_engine(trained_model, num_blocks=64, lora=LoRAConfig(
        enable_lora=True, max_loras=2, max_lora_rank=8,
        lora_modules={"upper": str(LORA / "upper"), "unsure": str(LORA / "unsure")}))
    prompt = 'What does "lantern" mean? ' * 6              # > 2 blocks of 16 tokens
    params = {n: SamplingParams(max_tokens=2, temperature=0, lora_name=n) for n in ("upper", "unsure", None)}
    assert engine.generate(prompt, params["upper"])[0].num_cached_tokens == 0
    assert engine.generate(prompt, params["unsure"])[0].num_cached_tokens == 0
    assert engine.generate(prompt, params[None])[0].num_cached_tokens == 0
    cached = engine.generate(prompt, params["upper"])[0].num_cached_tokens
    assert cached >= 32 and cached % 16 == 0


def test_scheduler_runs_at_most_max_loras_adapters():
    """FIFO admission stops at a sequence whose adapter would make max_loras + 1 distinct ones among the running;
    the base's sequences never count."""
    from quant_serve.engine.config import SchedulerConfig
    from quant_serve.engine.core.scheduler import Scheduler
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_loras=1), bm)
    seqs = [Sequence(f"s{i}", [5, 6, 7], SamplingParams(), lora_id=lora) for i, lora in enumerate([1, 0, 1, 2, 0])]
    for seq in seqs:
        sched.add_sequence(seq)
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["s0", "s1", "s2"]   # s3 (adapter 2) waits, s4 behind
    assert [s.request_id for s in sched.waiting] == ["s3", "s4"]
    for seq in seqs[:3]:
        sched.finish(seq, "stop")
    out = sched.schedule()
    assert [item.seq.request_id for item in out.scheduled] == ["s3", "s4"]
    for seq in seqs[3:]:
        sched.finish(seq, "stop")
    assert bm.num_free_blocks == 32


def test_memory_plan_counts_the_adapter_slots(engine, trained_model):
    """slot_bytes (what the CUDA memory plan reserves for --enable-lora) is the bytes of the slots' buffers."""
    from quant_serve.engine.lora.manager import slot_bytes
    from quant_serve.engine.plan.memory import plan_memory
    held = sum(b.numel() * b.element_size() for layer in engine.lora.layers.values() for b in layer.buffers())
    assert slot_bytes(engine.model_config, engine.config.lora, engine.dtype) == held
    plain, with_lora = (plan_memory(trained_model, gpu_mem_gb=4.0, max_model_len=512, lora_bytes=n)
                        for n in (0, held))
    assert with_lora.weights_bytes == plain.weights_bytes + held and with_lora.num_blocks < plain.num_blocks
