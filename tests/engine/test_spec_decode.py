"""Speculative decoding: prompt-lookup proposals, the acceptance rules (greedy exact; rejection sampling keeps the
target distribution), and the engine's output identical with and without speculation under greedy decoding."""
import pytest
import torch

from quant_serve.engine.config import SpeculativeConfig
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.spec.ngram import propose_ngram
from quant_serve.engine.spec.verify import accept_greedy, accept_sampled

from conftest import QWEN_7B
from helpers import assert_all_blocks_free, bench_script, make_engine


def test_propose_ngram_exact_cases():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]          # suffix [1, 2] seen at 0
    assert propose_ngram([5, 6, 7], 2, 1, 2) == []                           # nothing repeats
    assert propose_ngram([1, 2, 1, 2, 1, 2], 4, 2, 2) == [1, 2]              # latest occurrence, cut at the end
    # the longest suffix wins: [9, 1] matches at 4 (-> 2, 7, 9), [1] alone would match later
    assert propose_ngram([9, 1, 2, 3, 9, 1, 2, 7, 9, 1], 3, 1, 3) == [2, 7, 9]
    assert propose_ngram([4, 8, 4, 9, 3, 8], 2, 1, 1) == [4, 9]              # n = 1
    assert propose_ngram([4, 8, 4, 9, 3, 8], 2, 2, 3) == []                  # below prompt_lookup_min
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []                        # k = 0


def test_accept_greedy_exact_cases():
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]                     # all accepted + bonus
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]                        # first mismatch: the target's token
    assert accept_greedy([4, 6, 7], [5, 6]) == [4]
    assert accept_greedy([3], []) == [3]


def _empirical(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab).double() / len(draws)


@pytest.mark.parametrize("draft_kind", ["distribution", "point"])
def test_rejection_sampler_keeps_the_target_distribution(draft_kind):
    """Token 1 of each draw must follow the target p0, and token 2 (given token 1 accepted the proposal) p1,
    whatever the proposer's q. 20,000 draws on a 5-token vocabulary: the standard error of a frequency is at most
    0.0035; the tolerance is 0.015 (over 4 sigma), far below the gap to q (>= 0.2 on some token)."""
    vocab, n = 5, 20000
    gen = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.05, 0.30, 0.40, 0.20], [0.2] * 5],
                     dtype=torch.float64)                                          # [k + 1, V], k = 2
    q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10], [0.40, 0.10, 0.10, 0.10, 0.30]], dtype=torch.float64)
    firsts, seconds = [], []
    for _ in range(n):
        if draft_kind == "distribution":     # the proposer samples its tokens from q
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            out = accept_sampled(p, draft, q, gen)
        else:                                # prompt lookup: a fixed proposal, q a point mass
            draft = [1, 2]
            out = accept_sampled(p, draft, None, gen)
        assert 1 <= len(out) <= 3 and out[:len(out) - 1] == draft[:len(out) - 1]
        firsts.append(out[0])
        if len(out) >= 2:
            seconds.append(out[1])
    assert (_empirical(firsts, vocab) - p[0]).abs().max() < 0.015
    # the second token's position always conditions on the first token being the draft's; it must follow p1
    tol = 4 * (0.25 / len(seconds)) ** 0.5
    assert (_empirical(seconds, vocab) - p[1]).abs().max() < max(tol, 0.015)
    if draft_kind == "point":                 # acceptance probability of a point mass is p(d)
        assert abs(len(seconds) / n - 0.20) < 0.015


def _requests():
    # a line the trained model copies (the tiny model's Python documentation): prompt lookup proposes it
    copy = "Copy this exactly: list.append(x): Add an item to the end of the list.\nCopy: list.append(x): Add an item"
    return [
        ("copy", copy, SamplingParams(max_tokens=20, temperature=0)),
        ("count", "1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=7, temperature=0)),      # ends mid-run
        ("stop", "1, 2, 3, 4, 5, 6, 7,", SamplingParams(max_tokens=20, temperature=0, stop=["99, 99, 99"])),
        ("penalty", copy, SamplingParams(max_tokens=9, temperature=0, repetition_penalty=1.2)),  # never speculates
        ("random", copy, SamplingParams(max_tokens=12, temperature=0.8, seed=3)),
    ]


def _run(engine) -> dict[str, tuple]:
    """Arrivals staggered over the first steps: prompt chunks share steps with verifications."""
    pending, results, steps = _requests(), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            engine.add_request(*pending.pop(0))
        steps += 1
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                results[out.request_id] = (o.token_ids, o.text, o.finish_reason, o.stop_reason)
    return results


@pytest.fixture(scope="module")
def plain_results(trained_model):
    return _run(make_engine(trained_model, max_model_len=256))


def test_ngram_speculation_is_exact_under_greedy(plain_results, trained_model):
    engine = make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=8))
    got = _run(engine)
    for rid in ("copy", "count", "stop", "penalty"):
        assert got[rid] == plain_results[rid], rid
    assert got["stop"][2:] == ("stop", "99, 99, 99") and len(got["count"][0]) == 7
    stats = engine.spec_stats
    assert stats.num_accepted_tokens >= 10 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert len(got["random"][0]) == 12
    assert_all_blocks_free(engine)


def test_ngram_speculation_is_exact_with_an_int4_exact_window(trained_model):
    """Rejected proposals have written the ring (engine/worker/kv_exact_rows.py): the rows' ranges leave them out,
    so greedy output with speculation is the int4 engine's own without it (requests with logprobs do not speculate:
    the exact ranges themselves are checked in tests/engine/worker/test_kv_exact_rows.py)."""
    kw = dict(max_model_len=256, kv_cache_dtype="int4")
    plain = _run(make_engine(trained_model, **kw))
    engine = make_engine(trained_model, **kw, speculative=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=8))
    got = _run(engine)
    for rid in ("copy", "count", "stop", "penalty"):
        assert got[rid] == plain[rid], rid
    stats = engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens >= 10         # accepted and rejected proposals
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def two_layer_draft(tmp_path_factory, trained_model):
    """The trained model cut to its first 2 layers: the same tokenizer, proposals that are often wrong
    (rollbacks)."""
    out = tmp_path_factory.mktemp("draft") / "tiny-2-layers"
    return bench_script("spec_decode").truncated_model(trained_model, 2, out)


def test_draft_model_speculation_is_exact_under_greedy(plain_results, two_layer_draft, trained_model):
    engine = make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
        method="draft_model", model=str(two_layer_draft), num_speculative_tokens=3, disable_by_batch_size=8))
    got = _run(engine)
    for rid in ("copy", "count", "stop", "penalty"):
        assert got[rid] == plain_results[rid], rid
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens     # both accepted and rejected proposals
    assert_all_blocks_free(engine)
    draft = engine.proposer
    assert not draft.shadows and draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_speculation_turns_off_above_the_batch_size(trained_model):
    engine = make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, disable_by_batch_size=2))
    outs = engine.generate(["1, 2, 3, 4, 5, 6, 7,"] * 3, SamplingParams(max_tokens=8, temperature=0))
    assert engine.spec_stats.num_drafts == 0 and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_all_blocks_free(engine)


def test_draft_model_with_another_tokenizer_is_refused(tmp_path, two_layer_draft, trained_model):
    import json
    import shutil
    other = tmp_path / "other"
    shutil.copytree(two_layer_draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_changed"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizer"):
        make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
            method="draft_model", model=str(other), num_speculative_tokens=2))


def test_memory_plan_counts_the_draft_model(two_layer_draft):
    from quant_serve.engine.plan.memory import plan_memory
    config = QWEN_7B
    alone = plan_memory(config, gpu_mem_gb=24.0, max_model_len=4096)
    both = plan_memory(config, gpu_mem_gb=24.0, max_model_len=4096, draft_model=two_layer_draft)
    draft_kv_per_token = 2 * 2 * 2 * 64 * 2            # K and V, 2 layers, 2 KV heads, head_dim 64, fp16
    assert both.draft_weights_bytes == both.weights_bytes - alone.weights_bytes > 0
    assert both.draft_kv_cache_bytes == both.kv_cache_tokens * draft_kv_per_token
    free = alone.usable_bytes - both.weights_bytes - both.activation_bytes - both.cuda_graph_bytes - \
        both.overhead_bytes
    assert both.num_blocks == free // ((both.kv_bytes_per_token + draft_kv_per_token) * both.block_size)


def test_stop_token_inside_an_accepted_run_ends_there(plain_results, trained_model):
    """A stop token (handled like EOS) among the accepted tokens of a verification ends the sequence at it; the
    tokens verified after it vanish."""
    rid, prompt, params = _requests()[0]
    plain = plain_results[rid][0]

    def spec_run(stop_token_ids):
        engine = make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
            num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3))
        verified = []
        apply = engine.scheduler._apply_verified
        engine.scheduler._apply_verified = lambda item, tokens: \
            verified.append((len(item.seq.output_token_ids), list(tokens))) or apply(item, tokens)
        sp = SamplingParams(max_tokens=params.max_tokens, temperature=0, stop_token_ids=stop_token_ids)
        out = engine.generate(prompt, sp)[0].outputs[0]
        assert_all_blocks_free(engine)
        return out, verified

    _, verified = spec_run([])
    # a token that first appears as an accepted (not the last) token of a verification
    stop = next(t for base, run in verified for j, t in enumerate(run[:-1]) if plain.index(t) == base + j)
    out, verified = spec_run([stop])
    assert out.token_ids == plain[:plain.index(stop) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert any(stop in run[:-1] for _, run in verified)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cuda_speculation_under_graphs(method, trained_model):
    """On the GPU (fp16, decode graphs for the target and the draft): greedy tokens agree with the plain engine up
    to fp16 near-ties (verification runs the prefill path, decode the graphs), the tiny model as its own draft is
    nearly always accepted, and every block of both pools comes back."""
    model = trained_model
    spec = SpeculativeConfig(method=method, model=str(model) if method == "draft_model" else None,
                             num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=8)
    plain = make_engine(model, dtype="float16", device="cuda", max_model_len=256)
    engine = make_engine(model, dtype="float16", device="cuda", max_model_len=256, speculative=spec)
    prompts = [prompt for _, prompt, _ in _requests()[:3]]
    params = SamplingParams(max_tokens=32, temperature=0)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert [g[0] for g in got] == [r[0] for r in ref]
    agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r)) / sum(len(r) for r in ref)
    assert agree >= 0.9, f"only {agree:.0%} of greedy tokens agree with the plain engine"
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.acceptance_rate >= 0.8, stats
        assert engine.proposer.block_manager.num_free_blocks == engine.proposer.block_manager.num_blocks
    assert_all_blocks_free(engine)


def test_abort_while_speculating_frees_both_pools(two_layer_draft, trained_model):
    engine = make_engine(trained_model, max_model_len=256, speculative=SpeculativeConfig(
        method="draft_model", model=str(two_layer_draft), num_speculative_tokens=3))
    for rid, prompt, sp in _requests()[:2]:
        engine.add_request(rid, prompt, sp)
    for _ in range(4):
        engine.step()
    assert engine.proposer.shadows and engine.spec_stats.num_drafts > 0
    engine.abort("copy")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)
    draft = engine.proposer
    assert not draft.shadows and draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_backoff_after_verifications_that_accept_nothing():
    from quant_serve.engine.core.sequence import Sequence
    from quant_serve.engine.spec.backoff import Backoff
    seq = Sequence("s", [1, 2, 3], SamplingParams())
    backoff = Backoff(after=2)
    allowed = []

    def step(proposals: list[int], emitted: list[int]):
        ok = backoff.allow(seq)
        allowed.append(ok)
        seq.spec_token_ids = proposals if ok else []
        backoff.proposed(seq)
        seq.token_ids += emitted if ok else emitted[:1]
    step([7, 8], [7, 9])          # 1 accepted
    step([5], [6])                # miss 1
    step([5], [6])                # miss 2: skip the next 1 step
    step([5], [6])                # skipped
    step([5], [6])                # miss 3: skip the next 2
    step([5], [6])
    step([5], [6])
    step([4, 4], [4, 4, 4])       # allowed again, all accepted: misses reset
    step([5], [6])                # miss 1: still allowed after
    step([5], [6])
    assert allowed == [True, True, True, False, True, False, False, True, True, True]
    assert Backoff(after=0).allow(seq)


def test_draft_catch_up_stays_within_the_step_budget(plain_results, two_layer_draft, trained_model):
    """A first proposal forwards the prompt through the draft in chunks of at most max_num_batched_tokens (its warmup
    and the memory plan size activations for that), not all prompts at once; the greedy tokens stay exact."""
    engine = make_engine(trained_model, max_model_len=256, chunk=16, speculative=SpeculativeConfig(
        method="draft_model", model=str(two_layer_draft), num_speculative_tokens=3, disable_by_batch_size=8))
    sizes = []
    forward = engine.proposer.runner.forward
    engine.proposer.runner.forward = lambda out, *a, **kw: \
        sizes.append(sum(item.num_new_tokens for item in out.scheduled)) or forward(out, *a, **kw)
    requests = _requests()[:2]
    outs = engine.generate([prompt for _, prompt, _ in requests], [sp for _, _, sp in requests])
    for (rid, _, _), out in zip(requests, outs):
        assert out.outputs[0].token_ids == plain_results[rid][0], rid
    assert max(sizes) <= 16 and sum(sizes) > 40 and engine.spec_stats.num_accepted_tokens > 0
    assert_all_blocks_free(engine)
