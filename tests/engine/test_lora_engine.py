"""LoRA adapters on the engine (engine/lora/, quant/layers/lora.py): greedy tokens against transformers + peft with
the adapter merged into the weights, for each adapter alone and for the base and both adapters in one batch, on the
trained tiny model in FP16 (fp32 on CPU); the same adapters on the INT4 demo model; the refusals at load.

The adapters (tests/data/lora/, bench/train_lora_fixtures.py): `upper` answers in upper case (q, v, gate, down of
layers 4-7, alpha/r), `unsure` answers `I do not know what "X" means.` (k, o, up of layers 4-7, rsLoRA)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TESTS
from quant_serve.engine.config import LoRAConfig
from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sampling_params import SamplingParams
from helpers import assert_all_blocks_free, make_engine

LORA = TESTS / "data" / "lora"
ADAPTERS = {"upper": LORA / "upper", "unsure": LORA / "unsure"}
WORDS = ["lantern", "harbor", "pebble"]          # "pebble" and "harbor" are not among the training words
NEW_TOKENS = 16


def lora_engine(model, **kw):
    return make_engine(model, lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8,
                                              lora_modules={k: str(v) for k, v in ADAPTERS.items()}), **kw)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f'What does "{w}" mean?'}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for w in WORDS]


def _hf_greedy(model, prompts):
    """Up to NEW_TOKENS greedy tokens, through the first EOS (the engine's output holds it too). No min_tokens: with
    async scheduling the engine lets EOS through at the last position min_tokens covers (a sampling that runs behind
    counts its own token as pending), which is not what these tests are about."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 attention_mask=torch.ones(1, len(ids)))[0, len(ids):].tolist()
        ends = [i for i, t in enumerate(out) if t in eos]
        outs.append(out[:ends[0] + 1] if ends else out)
    return outs


@pytest.fixture(scope="module")
def reference(trained_model, prompts):
    """adapter name (None: the base) -> transformers' greedy tokens per prompt, the adapter merged by peft."""
    from peft import PeftModel
    refs = {None: _hf_greedy(AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32).eval(),
                             prompts)}
    for name, path in ADAPTERS.items():
        base = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(path)).merge_and_unload().eval()
        refs[name] = _hf_greedy(merged, prompts)
    return refs


@pytest.fixture(scope="module")
def engine(trained_model):
    return lora_engine(trained_model)


def _params(name):
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, lora_name=name)


def test_adapters_change_the_answers(reference, tokenizer):
    """The fixture is meaningful: each adapter's answers differ from the base's, as trained."""
    upper = tokenizer.decode(reference["upper"][0])
    assert upper == upper.upper() and any(c.isalpha() for c in upper), upper
    assert tokenizer.decode(reference["unsure"][1]).startswith('I do not know what "harbor"')
    assert reference[None] != reference["upper"] and reference[None] != reference["unsure"]


@pytest.mark.parametrize("name", ["upper", "unsure"])
def test_each_adapter_alone_matches_peft_merged(name, engine, prompts, reference):
    outs = engine.generate(prompts, _params(name))
    assert [o.outputs[0].token_ids for o in outs] == reference[name]
    assert_all_blocks_free(engine)


def test_base_and_two_adapters_in_one_batch_match_peft(engine, prompts, reference, monkeypatch):
    steps = []
    step_slots = engine.lora.step_slots
    monkeypatch.setattr(engine.lora, "step_slots",
                        lambda scheduled: steps.append(s := step_slots(scheduled)) or s)
    names = [None, "upper", "unsure"]
    jobs = [(ids, name) for ids in prompts for name in names]
    outs = engine.generate([ids for ids, _ in jobs], [_params(name) for _, name in jobs])
    for (ids, name), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == reference[name][prompts.index(ids)], (name, ids)
    slots = {engine.lora.get(n).slot for n in ("upper", "unsure")}
    # one step ran the base and both adapters together (decode steps: one row per sequence)
    assert any(s is not None and set(s.tolist()) == {-1} | slots and len(s) == len(jobs) for s in steps)
    assert_all_blocks_free(engine)


def test_a_batch_without_adapters_runs_the_base_alone(engine, prompts, reference):
    outs = engine.generate(prompts, _params(None))
    assert [o.outputs[0].token_ids for o in outs] == reference[None]
    assert engine.lora.batch.slots is None


def test_upper_adapter_on_the_int4_demo_model(tokenizer, prompts):
    """The delta is added to the output of any base layer: on the INT4 AWQ demo model (the weights the adapter
    was trained on, before dequantization) the adapter still answers in upper case, the base does not."""
    engine = lora_engine(DEMO_MODEL_DIR)
    base, upper = engine.generate([prompts[0]] * 2, [_params(None), _params("upper")])
    base_text, upper_text = base.outputs[0].text, upper.outputs[0].text
    assert upper_text == upper_text.upper() and sum(c.isalpha() for c in upper_text) > 10, upper_text
    assert base_text != base_text.upper(), base_text


def test_unknown_adapter_name_and_engine_without_lora_are_refused(engine, trained_model, prompts):
    with pytest.raises(ValueError, match=r"LoRA adapter 'nope' is not loaded \(loaded: upper, unsure\)"):
        engine.add_request("r-nope", prompts[0], _params("nope"))
    plain = make_engine(trained_model, num_blocks=16)
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        plain.add_request("r", prompts[0], _params("upper"))
    with pytest.raises(ValueError, match="without --enable-lora"):
        plain.load_lora_adapter("upper", str(ADAPTERS["upper"]))


def test_load_unload_at_runtime(trained_model, prompts, reference):
    engine = make_engine(trained_model, lora=LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=8))
    engine.load_lora_adapter("upper", str(ADAPTERS["upper"]))
    first_id = engine.lora.get("upper").lora_id
    with pytest.raises(ValueError, match=r"1 adapters are loaded \(upper\), the most --max-cpu-loras allows"):
        engine.load_lora_adapter("unsure", str(ADAPTERS["unsure"]))
    engine.add_request("busy", prompts[0], _params("upper"))
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.unload_lora_adapter("upper")
    engine.abort("busy")
    engine.unload_lora_adapter("upper")
    engine.load_lora_adapter("unsure", str(ADAPTERS["unsure"]))
    assert engine.lora.get("unsure").slot == 0 and engine.lora.get("unsure").lora_id != first_id   # ids not reused
    outs = engine.generate(prompts, _params("unsure"))
    assert [o.outputs[0].token_ids for o in outs] == reference["unsure"]


@pytest.mark.parametrize("name", ["upper", "unsure"])
def test_prompt_logprobs_match_peft_merged(name, engine, trained_model, prompts, reference):
    """Closer than greedy tokens (an over-trained adapter answers the same at a wrong scale): the log-probability
    of every token of prompt + answer under the adapter, against peft's merged model."""
    from peft import PeftModel
    ids = prompts[1] + reference[name][1]
    base = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(ADAPTERS[name])).merge_and_unload().eval()
    with torch.no_grad():
        logp = merged(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                                lora_name=name))[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


@pytest.fixture(scope="module")
def gguf_dir(trained_model, tmp_path_factory):
    from gguf_fixtures import write_gguf
    directory = tmp_path_factory.mktemp("lora-gguf")
    return {mix: write_gguf(trained_model, directory / f"tiny-{mix}.gguf", mix) for mix in ("F16", "Q4_K_M")}


def test_adapter_on_a_gguf_base(gguf_dir, trained_model, prompts, reference):
    """GGUF F16 (the trained model's own weights): the prompt logprobs under `unsure` equal peft's merged model;
    Q4_K_M (K-quant layers, the 6-bit ones included): `upper` still answers in upper case."""
    from peft import PeftModel
    engine = lora_engine(gguf_dir["F16"])
    ids = prompts[2] + reference["unsure"][2]
    base = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(ADAPTERS["unsure"])).merge_and_unload().eval()
    with torch.no_grad():
        want = merged(torch.tensor([ids])).logits[0].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                                lora_name="unsure"))[0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]]), want, rtol=0,
                               atol=2e-3)
    engine = lora_engine(gguf_dir["Q4_K_M"])
    text = engine.generate([prompts[0]], _params("upper"))[0].outputs[0].text
    assert text == text.upper() and sum(c.isalpha() for c in text) > 10, text


def test_adapters_under_ngram_speculation(trained_model, prompts, reference):
    """A verification step (k + 1 token rows per sequence) gives every row its sequence's adapter."""
    from quant_serve.engine.config import SpeculativeConfig
    engine = lora_engine(trained_model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                      prompt_lookup_min=1))
    names = ["upper", None, "unsure"]
    outs = engine.generate(prompts, [_params(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [reference[n][i] for i, n in enumerate(names)]
    assert engine.spec_stats.num_draft_tokens > 0          # proposals were verified
    assert_all_blocks_free(engine)


def test_more_adapters_than_slots_swap_in_lru(trained_model, prompts, reference, monkeypatch):
    """--max-loras 1 --max-cpu-loras 2: both adapters stay loaded in host memory; the scheduler runs one adapter's
    sequences (with the base's) at a time and the slot takes the other when its turn comes."""
    engine = make_engine(trained_model, lora=LoRAConfig(
        enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8,
        lora_modules={k: str(v) for k, v in ADAPTERS.items()}))
    assert engine.lora.get("upper").slot == 0 and engine.lora.get("unsure").slot is None
    steps = []
    step_slots = engine.lora.step_slots
    monkeypatch.setattr(engine.lora, "step_slots", lambda scheduled: steps.append(
        {item.seq.lora_id for item in scheduled}) or step_slots(scheduled))
    names = ["unsure", "upper", None, "unsure", "upper", None]
    jobs = [(i % len(prompts), name) for i, name in enumerate(names)]
    outs = engine.generate([prompts[i] for i, _ in jobs], [_params(n) for _, n in jobs])
    assert [o.outputs[0].token_ids for o in outs] == [reference[n][i] for i, n in jobs]
    assert all(len(ids - {0}) <= 1 for ids in steps)                   # never two adapters in one step
    ran = set().union(*steps)
    assert {engine.lora.get(n).lora_id for n in ADAPTERS} <= ran and 0 in ran
    assert engine.lora.num_slot_loads >= 3         # upper at load, then unsure, then upper again
    assert_all_blocks_free(engine)
