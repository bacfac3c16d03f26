"""Structured outputs in the engine: the bitmask application is exact, constrained rows never sample a token their
grammar forbids while the other rows of the batch sample as if alone, EOS comes only once the grammar accepts, and
whole requests (n > 1, stop strings, prefix caching, async scheduling) produce output that validates."""
import json
import re

from typing import Literal

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sample.sampler import Sampler
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.sample.structured import GrammarCompiler, StructuredOutputsParams, StructuredOutputsUnavailable
from quant_serve.engine.sample.structured_mask import GrammarMasks, allowed_tokens, apply_bitmask

from helpers import assert_all_blocks_free, make_engine

VOCAB = 8192          # the demo model's
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_apply_bitmask_masks_exactly_the_cleared_bits(device):
    rng = np.random.default_rng(0)
    vocab = 1000                                        # not a multiple of 32: the last word's high bits are ignored
    mask = rng.integers(-2**31, 2**31, size=(4, 32), dtype=np.int64).astype(np.int32)
    mask[2] = -1                                         # an unconstrained row
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    for r in range(4):
        for t in range(vocab):
            if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    out = logits.to(device)
    apply_bitmask(out, mask)                              # CPU: numpy unpacks; CUDA: the device unpacks
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(out[2].cpu(), logits[2])
    # the unpacking the GPU path runs (on the device), here on CPU tensors: the same bits
    assert torch.equal(allowed_tokens(torch.from_numpy(mask), vocab), expected != float("-inf"))


def _seq(request_id: str, constraint: dict | None = None, **params) -> Sequence:
    return Sequence(request_id, [1, 5, 6], SamplingParams(structured_outputs=constraint, **params),
                    eos_token_ids=(EOS,))


def _adversarial_logits(rows: int, step: int, tokenizer) -> torch.Tensor:
    """Random logits with EOS and letter tokens far ahead of the rest: a grammar of digits has to hold them off."""
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(step)) * 2
    logits[:, EOS] += 30
    logits[:, [tokenizer.convert_tokens_to_ids(c) for c in "abcxyz"]] += 25
    return logits


def test_masked_tokens_are_never_sampled_and_rows_are_independent(compiler, tokenizer):
    constrained = lambda name: _seq(name, {"regex": "[0-9]{3,12}"}, temperature=1.0, seed=11, max_tokens=40)
    free = lambda name: _seq(name, temperature=1.0, seed=5, max_tokens=40)
    greedy = lambda name: _seq(name, temperature=0.0, max_tokens=40)
    mixed = [constrained("c0"), free("f"), greedy("g"), constrained("c1")]
    alone = {"c0": [constrained("c0")], "f": [free("f")], "g": [greedy("g")]}
    sampler, solo = Sampler(grammars=GrammarMasks(compiler)), Sampler(grammars=GrammarMasks(compiler))
    for step in range(14):
        logits = _adversarial_logits(4, step, tokenizer)
        tokens = sampler(logits.clone(), mixed).token_ids
        for row, name in ((0, "c0"), (1, "f"), (2, "g")):       # each row samples as it would alone
            seq = alone[name][0]
            if not seq.is_finished:
                assert solo(logits[row:row + 1].clone(), [seq]).token_ids == [tokens[row]], (step, name)
                seq.append_token(tokens[row])
        for seq, token in zip(mixed, tokens):
            seq.append_token(token)
    for seq in (mixed[0], mixed[3]):
        out = seq.output_token_ids
        end = out.index(EOS)                     # EOS came, and only once 3 to 12 digits were there
        assert re.fullmatch("[0-9]{3,12}", tokenizer.decode(out[:end])), tokenizer.decode(out)
        assert set(out[end:]) == {EOS}           # a complete grammar allows nothing else
    assert EOS in mixed[1].output_token_ids[:3] and mixed[2].output_token_ids[0] == EOS   # the logits favour EOS


def test_choice_holds_eos_until_complete_and_wins_over_min_tokens(compiler, tokenizer):
    sampler = Sampler(grammars=GrammarMasks(compiler))
    seq = _seq("r", {"choice": ["alphabet", "beta"]}, temperature=0.0, min_tokens=12)
    for step in range(10):
        logits = torch.zeros(1, VOCAB)
        logits[0, EOS] = 50.0                    # EOS first everywhere
        seq.append_token(sampler(logits, [seq]).token_ids[0])
    text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    assert text in ("alphabet", "beta")
    assert seq.output_token_ids[-1] == EOS       # min_tokens cannot forbid the only token the grammar allows


def test_every_eos_id_of_the_model_ends_a_complete_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS, 0))           # <|im_end|> and <|endoftext|>
    grammars = GrammarMasks(compiler)
    seq = _seq("r", {"choice": ["yes"]})
    seq.eos_token_ids = (EOS, 0)
    mask, complete = grammars.fill([seq], VOCAB)
    assert not mask[0, 0] & 0b101 and complete == []                   # neither EOS before the grammar accepts
    seq.token_ids += tokenizer.encode("yes")
    mask, complete = grammars.fill([seq], VOCAB)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
    assert allowed.tolist() == [0, EOS] and complete == [0]
    seq.append_token(0)                                                # the second EOS id is taken as the EOS
    grammars.fill([seq], VOCAB)
    assert not grammars._states["r"].matcher.is_error()


def test_bad_constraints_are_refused_naming_the_problem(compiler):
    with pytest.raises(ValueError, match="cannot be compiled.*objekt"):
        compiler.compile(StructuredOutputsParams(json={"type": "objekt"}))
    with pytest.raises(ValueError, match="(?s)regex constraint cannot be compiled.*unclosed group"):
        compiler.compile(StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="not valid JSON"):
        compiler.compile(StructuredOutputsParams(json="{nope"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    word: str = Field(max_length=12)
    count: int = Field(ge=0, le=99)
    kind: Literal["noun", "verb"]


SCHEMA = Entry.model_json_schema()
PROMPT = '<|im_start|>user\nWhat does "harbor" mean? Answer in JSON.<|im_end|>\n<|im_start|>assistant\n'


def _requests() -> list[tuple[str, str, SamplingParams, int]]:
    return [
        ("json", PROMPT, SamplingParams(max_tokens=48, temperature=0.9, seed=3,
                                        structured_outputs={"json": SCHEMA}), 3),
        ("free", PROMPT, SamplingParams(max_tokens=12, temperature=0.0), 1),
        ("stop", PROMPT, SamplingParams(max_tokens=20, temperature=0.0, stop=[" END"],
                                        structured_outputs={"regex": "[a-z]{1,6} END [a-z]{1,6}"}), 1),
        ("object", PROMPT, SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"json_object": True}), 2),
    ]


def _run(engine) -> dict:
    for rid, prompt, params, n in _requests():
        engine.add_request(rid, prompt, params, n=n)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs]
    return final


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_requests_validate_with_n_stop_strings_prefix_caching_and_async_scheduling(trained_model, device):
    model = trained_model
    # prefix caching is on; on CUDA the decode graphs run (the constrained rows' logits come out of them)
    ahead = make_engine(model, async_scheduling=True, max_model_len=256, device=device)
    results = _run(ahead)
    assert results == _run(make_engine(model, async_scheduling=False, max_model_len=256, device=device))
    assert_all_blocks_free(ahead)
    for _, text, reason, _ in results["json"]:
        assert reason == "stop", text
        Entry.model_validate_json(text)
    assert len({text for _, text, _, _ in results["json"]}) > 1                  # n = 3 sampled apart
    (_, text, reason, stop), = results["stop"]
    assert (reason, stop) == ("stop", " END") and re.fullmatch("[a-z]{1,6}", text)
    for _, text, reason, _ in results["object"]:
        assert reason == "length" or isinstance(json.loads(text), dict)
    # the same engine serves again: a second round hits the prefix cache and still validates
    hits = ahead.block_manager.prefix_hits
    assert _run(ahead) == results and ahead.block_manager.prefix_hits > hits


def test_engine_refuses_a_constraint_that_cannot_compile(trained_model):
    engine = make_engine(trained_model, max_model_len=128)
    with pytest.raises(ValueError, match="cannot be compiled"):
        engine.add_request("bad", "hi", SamplingParams(structured_outputs={"json": {"type": "objekt"}}))
    assert not engine.has_unfinished_requests()


def test_without_the_grammar_library_the_error_names_it(tokenizer, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)      # import llguidance raises ImportError
    with pytest.raises(StructuredOutputsUnavailable, match="llguidance package"):
        GrammarCompiler(tokenizer, VOCAB, (EOS,)).compile(StructuredOutputsParams(regex="a+"))


def test_bench_offline_constrains_every_request(trained_model):
    import llguidance

    from quant_serve.server.cli.bench_offline import BENCH_JSON_SCHEMA, run_offline
    engine = make_engine(trained_model, max_model_len=128)
    constraint = StructuredOutputsParams(json=BENCH_JSON_SCHEMA)
    finished, step = [], engine.step
    engine.step = lambda: [o for o in step() if not o.finished or finished.append(o) or True]
    result = run_offline(engine, 3, 8, 24, structured_outputs=constraint, warmup=0)
    assert result["num_prompts"] == 3 and len(finished) == 3
    grammar = engine.grammar_compiler.compile(constraint)
    for out in finished:           # every token the bench generated is one the schema's grammar takes
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 24 and out.outputs[0].text.startswith('{"items": [')
        assert llguidance.LLMatcher(engine.grammar_compiler.tokenizer, grammar).consume_tokens(tokens)


def test_an_eos_the_tokenizer_does_not_know_falls_back_to_its_own():
    """A dummy-weight 7B config on the demo tokenizer (the structured-outputs bench): the config's EOS 151645 is past
    the tokenizer's 8,192 tokens, which llguidance refuses; the tokenizer's own EOS serves instead."""
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    compiler = GrammarCompiler(tok, 152064, (151645,))
    assert compiler.eos_token_ids == [tok.eos_token_id]
    assert compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
