"""Task scoring through the engine's batched prompt-logprobs path equals engine.score on each sequence alone;
generation exact match; the lm-eval adapter (skipped without lm-eval) agrees with the engine."""
from types import SimpleNamespace

import pytest
import torch

from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.eval.tasks import GENERATION, Task, choice_scores, load_task, run_generation
from helpers import make_engine


@pytest.fixture(scope="module")
def engine(trained_model):
    return make_engine(trained_model, prefix_caching=False, max_model_len=512)


def scored_alone(engine, context: str, continuation: str) -> float:
    ctx = engine.tokenizer.encode(context)
    whole = engine.tokenizer.encode(context + continuation)
    logprobs = engine.score(whole).log_softmax(dim=-1)                       # row i predicts token i + 1
    positions = torch.arange(len(ctx), len(whole))
    return logprobs[positions - 1, torch.tensor(whole)[positions]].sum().item()


def test_choice_scores_equal_scoring_each_choice_alone(engine):
    items = load_task("definitions", limit=2).items
    scores = choice_scores(engine, items)
    for item, row in zip(items, scores):
        assert row == pytest.approx([scored_alone(engine, item["context"], c) for c in item["choices"]], abs=1e-3)


def test_generation_exact_match(engine):
    items = load_task("definitions_gen", limit=3).items
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": items[0]["prompt"]}], tokenize=False,
                                                  add_generation_prompt=True)
    alone = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop=[":", "\n"]))[0]
    text = alone.outputs[0].text.strip()
    rigged = [dict(items[0], answer=text), dict(items[0], answer=text + "x")] + items[1:]
    result = run_generation(engine, Task("t", GENERATION, rigged, "-"), "test")
    assert result.correct[:2] == [True, False]


def test_lm_eval_adapter_matches_the_engine(engine, trained_model):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
    from quant_serve.eval.lm_eval_adapter import register
    cls = register()
    assert register() is cls                                                  # idempotent
    from lm_eval.api.registry import get_model
    assert get_model("quant-serve") is cls
    lm = cls(model=str(trained_model), device="cpu", dtype="float32", max_model_len=512)
    context, continuation = "Pyrotartrate (n):", " A salt of pyrotartaric acid."
    [(logprob, greedy)] = lm.loglikelihood([SimpleNamespace(args=(context, continuation))])
    assert logprob == pytest.approx(scored_alone(engine, context, continuation), abs=1e-3) and greedy is False
    text = "The quick brown fox jumps over the lazy dog. " * 60                # > max_model_len: rolling windows
    [rolling] = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    ids = engine.tokenizer.encode(text)
    eos = engine.tokenizer.eos_token_id
    expected = scored_alone(engine, engine.tokenizer.decode([eos]), engine.tokenizer.decode(ids[:511]))
    assert rolling < expected < 0                                              # the tail adds its own log-prob
    [generated] = lm.generate_until([SimpleNamespace(args=("Hellhound (n):", {"until": ["\n"], "max_gen_toks": 12}))])
    direct = engine.generate(["Hellhound (n):"], SamplingParams(max_tokens=12, temperature=0, stop=["\n"]))[0]
    assert generated == direct.outputs[0].text
