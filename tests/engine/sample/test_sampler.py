import math

import pytest
import torch

from quant_serve.engine.sample.sampler import (Sampler, apply_logit_bias, apply_min_tokens, apply_penalties,
                                               compute_prompt_logprobs)
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import Sequence

VOCAB = 50


def make_seq(request_id="r", prompt=(3, 4), output=(), eos=(), **params) -> Sequence:
    seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt), params=SamplingParams(**params),
                   eos_token_ids=tuple(eos))
    for t in output:
        seq.append_token(t)
    return seq


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_for_a_large_batch():
    logits = random_logits(256, vocab=1000)
    seqs = [make_seq(f"r{i}", temperature=0.0) for i in range(256)]
    out = Sampler()(logits.half(), seqs)
    assert out.token_ids == logits.half().float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 256


def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert Sampler()(logits, [make_seq(temperature=0.0)]).token_ids == [1]
    # greedy rows without logprobs take the argmax of the model-dtype logits (the runner skips the fp32 copy)
    assert Sampler()(torch.tensor([[0.0, 5.0, 5.001, 1.0]]).half(), [make_seq(temperature=0.0)]).token_ids == [1]


def test_penalties_change_exactly_the_expected_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    seqs = [
        # repetition over prompt {0, 4} and output {1, 3}; presence / frequency over output only {1: 2, 3: 1}
        make_seq("a", prompt=[0, 4], output=[1, 3, 1], repetition_penalty=2.0,
                 presence_penalty=0.25, frequency_penalty=0.5),
        make_seq("b", prompt=[0, 4], output=[1, 3, 1]),     # no penalties: untouched
    ]
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.25 - 2 * 0.5, 0.5, 3.0 / 2 - 0.25 - 0.5, -2.0 * 2, 1.0],
                             [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    original = logits.clone()
    out = apply_penalties(logits, seqs)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, original)     # the caller's tensor is not modified


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 6)
    out = apply_penalties(logits, [make_seq(prompt=[0, 0, 5], output=[2, 2], presence_penalty=1.0,
                                            frequency_penalty=0.5)])
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, -2.0, 0.0, 0.0, 0.0]]), rtol=0, atol=0)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0]])
    sampler = Sampler()
    assert sampler(logits, [make_seq(output=[0], temperature=0.0)]).token_ids == [0]
    assert sampler(logits, [make_seq(output=[0], temperature=0.0, repetition_penalty=1.5)]).token_ids == [1]
    assert sampler(logits, [make_seq(output=[0], temperature=0.0, frequency_penalty=1.5)]).token_ids == [1]
    assert sampler(logits, [make_seq(prompt=[0], temperature=0.0, presence_penalty=2.0)]).token_ids == [0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]] * 3)
    seqs = [
        make_seq("a", output=[3], eos=(0,), temperature=0.0, min_tokens=2, stop_token_ids=[1]),
        make_seq("b", output=[3, 3], eos=(0,), temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # reached
        make_seq("c", output=[], eos=(0,), temperature=0.0, min_tokens=1, ignore_eos=True),
    ]
    masked = apply_min_tokens(logits, seqs)
    inf = float("-inf")
    assert masked.tolist() == [[inf, inf, 7.0, 1.0], [9.0, 8.0, 7.0, 1.0], [inf, 8.0, 7.0, 1.0]]
    assert Sampler()(logits, seqs).token_ids == [2, 0, 1]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(64)
    greedy = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=3)
    assert sampler(logits, [make_seq(f"k{i}", temperature=1.5, top_k=1) for i in range(64)]).token_ids == greedy
    assert sampler(logits, [make_seq(f"p{i}", temperature=1.5, top_p=1e-6) for i in range(64)]).token_ids == greedy
    # control: without the filters a hot temperature does not reproduce argmax
    assert sampler(logits, [make_seq(f"t{i}", temperature=1.5) for i in range(64)]).token_ids != greedy


def draw(logits_row: list[float], n: int, seed: int = 0, **params) -> list[float]:
    """Empirical token frequencies of n draws (one batch of n identical rows, one sampler seed)."""
    logits = torch.tensor([logits_row] * n)
    tokens = Sampler(seed=seed)(logits, [make_seq(f"r{i}", **params) for i in range(n)]).token_ids
    return [tokens.count(t) / n for t in range(len(logits_row))]


def test_sampling_distribution_matches_softmax_over_temperature():
    logits = [1.0, 0.5, 0.0, -1.0]
    expected = torch.softmax(torch.tensor(logits) / 0.7, dim=-1).tolist()
    freqs = draw(logits, 4000, seed=1234, temperature=0.7)
    for f, p in zip(freqs, expected):
        assert abs(f - p) < 0.03, (freqs, expected)


def test_top_k_distribution():
    logits = [2.0, 1.5, 1.0, 0.5]
    freqs = draw(logits, 4000, seed=7, temperature=1.0, top_k=2)
    expected = torch.softmax(torch.tensor(logits[:2]), dim=-1).tolist() + [0.0, 0.0]
    for f, p in zip(freqs, expected):
        assert abs(f - p) < 0.03, (freqs, expected)


@pytest.mark.parametrize("top_p, kept", [(0.45, 1), (0.6, 2), (0.85, 3), (0.97, 4)])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]      # cumulative 0.5, 0.8, 0.95, 1.0
    freqs = draw([math.log(p) for p in probs], 4000, seed=11, top_p=top_p)
    expected = [p / sum(probs[:kept]) for p in probs[:kept]] + [0.0] * (4 - kept)
    assert [f > 0 for f in freqs] == [p > 0 for p in expected], freqs
    for f, p in zip(freqs, expected):
        assert abs(f - p) < 0.03, (freqs, expected)


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.5, 0.3, 0.15, 0.05]
    freqs = draw([math.log(p) for p in probs], 4000, seed=5, min_p=0.2)   # threshold 0.1 drops only token 3
    assert freqs[3] == 0
    for f, p in zip(freqs[:3], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]):
        assert abs(f - p) < 0.03, freqs


def test_min_p_applies_after_temperature():
    probs = [0.5, 0.3, 0.15, 0.05]
    # at T=3 token 3 has (0.05 / 0.5) ** (1/3) = 0.46 of the max probability, above min_p
    freqs = draw([math.log(p) for p in probs], 4000, seed=5, min_p=0.2, temperature=3.0)
    tempered = torch.softmax(torch.tensor(probs).log() / 3.0, dim=-1).tolist()
    for f, p in zip(freqs, tempered):
        assert abs(f - p) < 0.03, (freqs, tempered)


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    steps = random_logits(20, seed=100)       # the target's logits at each of 20 decode steps

    def run(others: list[Sequence]) -> list[int]:
        sampler = Sampler(seed=len(others))
        target = make_seq("target", seed=42, temperature=1.0, top_p=0.9)
        batch = others[:1] + [target] + others[1:]
        pos = batch.index(target)
        tokens = []
        for s in range(len(steps)):
            other_rows = random_logits(len(others), seed=s)
            logits = torch.cat([other_rows[:pos], steps[s:s + 1], other_rows[pos:]])
            tok = sampler(logits, batch).token_ids[pos]
            tokens.append(tok)
            target.append_token(tok)
        return tokens

    alone = run([])
    assert run([make_seq(f"o{j}", temperature=0.8) for j in range(5)]) == alone
    seeded_and_greedy = [make_seq(f"s{j}", seed=1000 + j, top_k=5) for j in range(3)] + [make_seq("g", temperature=0.0)]
    assert run(seeded_and_greedy) == alone
    assert len(set(alone)) > 3     # really sampled, not a constant

    other_seed = make_seq("x", seed=43, temperature=1.0, top_p=0.9)
    sampler = Sampler()
    assert [sampler(steps[s:s + 1], [other_seed]).token_ids[0] for s in range(len(steps))] != alone


def test_release_drops_the_request_generator():
    logits = random_logits(1)
    sampler = Sampler()
    seq = make_seq("a", seed=9)
    first = [sampler(logits, [seq]).token_ids[0] for _ in range(10)]
    continued = [sampler(logits, [seq]).token_ids[0] for _ in range(10)]
    sampler.release("a")
    restarted = [sampler(logits, [seq]).token_ids[0] for _ in range(10)]
    assert restarted == first
    assert continued != first     # the generator state advances between steps while the request lives


def test_logprobs_come_from_raw_logits_with_sorted_top():
    logits = random_logits(3)
    seqs = [
        make_seq("a", temperature=0.5, logprobs=5, repetition_penalty=1.3, output=[7]),
        make_seq("b", temperature=0.0, logprobs=0),
        make_seq("c", temperature=1.0),
    ]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    a, b, c = out.logprobs
    assert c is None
    assert a.token_id == out.token_ids[0] and b.token_id == out.token_ids[1]
    assert a.logprob == pytest.approx(raw[0, a.token_id].item(), abs=1e-6)
    assert b.logprob == pytest.approx(raw[1, b.token_id].item(), abs=1e-6)
    assert b.top == []
    order = raw[0].argsort(descending=True)[:5].tolist()
    assert [t for t, _ in a.top] == order
    assert [lp for _, lp in a.top] == pytest.approx(raw[0, order].tolist(), abs=1e-6)
    assert all(x[1] >= y[1] for x, y in zip(a.top, a.top[1:]))


def test_compute_prompt_logprobs():
    logits = random_logits(4, vocab=10)
    targets = [3, 0, 9, 5]
    out = compute_prompt_logprobs(logits.half(), targets, k=3)
    raw = torch.log_softmax(logits.half().float(), dim=-1)
    assert [lp.token_id for lp in out] == targets
    for j, lp in enumerate(out):
        assert lp.logprob == pytest.approx(raw[j, targets[j]].item(), abs=1e-6)
        top_ids = raw[j].argsort(descending=True)[:3].tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert [v for _, v in lp.top] == pytest.approx(raw[j, top_ids].tolist(), abs=1e-6)
    assert all(lp.top == [] for lp in compute_prompt_logprobs(logits, targets, k=0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logit_bias_is_added_per_row_in_one_batch(device):
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]] * 3, device=device)
    seqs = [make_seq("a", temperature=0.0, logit_bias={0: 5.0, 3: -1.0}),
            make_seq("b", temperature=0.0),                              # no bias: untouched
            make_seq("c", temperature=0.0, logit_bias={1: 0.5})]
    biased = apply_logit_bias(logits, seqs)
    assert biased.tolist() == [[6.0, 2.0, 3.0, -1.0], [1.0, 2.0, 3.0, 0.0], [1.0, 2.5, 3.0, 0.0]]
    assert logits[0, 0].item() == 1.0           # the caller's tensor is not modified
    assert Sampler()(logits, seqs).token_ids == [0, 2, 2]


def test_logit_bias_steers_sampled_rows_and_is_clamped():
    logits = random_logits(64)
    seqs = [make_seq(f"r{i}", temperature=1.0, logit_bias={7: 1e9}) for i in range(64)]
    assert seqs[0].params.logit_bias == {7: 100.0}           # OpenAI's range
    assert Sampler(seed=1)(logits, seqs).token_ids == [7] * 64
    banned = [make_seq(f"g{i}", temperature=0.0, logit_bias={t: -100.0 for t in range(VOCAB) if t != 3})
              for i in range(2)]
    assert Sampler()(random_logits(2), banned).token_ids == [3, 3]


def test_logit_bias_keeps_raw_logprobs():
    logits = random_logits(1)
    out = Sampler()(logits, [make_seq(temperature=0.0, logprobs=1, logit_bias={5: 100.0})])
    assert out.token_ids == [5]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 5].item(), abs=1e-6)


@pytest.mark.parametrize("bias, message", [({3: float("nan")}, "finite"), ({-2: 1.0}, "non-negative")])
def test_bad_logit_bias_is_refused(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
