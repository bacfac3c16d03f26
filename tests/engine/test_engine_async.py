"""Async scheduling (a decode step launched before the previous step's tokens reach the host) must not change what
requests get: same tokens, text, finish reasons and logprobs as the synchronous engine, and no leaked block."""
import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.sampling_params import SamplingParams

from helpers import assert_all_blocks_free, make_engine

PROMPTS = ["The meaning of the word", 'What does "harbor" mean?', "Once upon a time", "A list of fruits:"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=17, temperature=0.8, seed=7, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0, stop=[" the", "."]),           # stop strings end it early
        SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3),          # steps with it run in sync
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=6, temperature=0, min_tokens=2),
    ]


def _run(engine, staggered: bool) -> dict[str, tuple]:
    results, pending, steps = {}, [(f"r{i}-{j}", p, sp) for j, sp in enumerate(_params())
                                   for i, p in enumerate(PROMPTS[:2])], 0
    if not staggered:
        for rid, prompt, sp in pending:
            engine.add_request(rid, prompt, sp)
        pending = []
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:        # arrivals admitted behind a step in flight
            engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                results[out.request_id] = (o.token_ids, o.text, o.finish_reason, o.stop_reason,
                                           [(lp.token_id, round(lp.logprob, 4)) for lp in o.logprobs or []])
        steps += 1
    return results


@pytest.mark.parametrize("staggered", [False, True])
def test_async_scheduling_matches_sync(staggered):
    sync = make_engine(DEMO_MODEL_DIR, async_scheduling=False, max_model_len=256)
    ahead = make_engine(DEMO_MODEL_DIR, async_scheduling=True, max_model_len=256)
    launched = []                              # steps launched behind one in flight (their inputs carried over)
    real = ahead.runner.launch
    ahead.runner.launch = lambda out, carry=None: (carry is not None and launched.append(1)) or real(out, carry)
    expected = _run(sync, staggered)
    assert _run(ahead, staggered) == expected
    assert len(launched) > 5                   # the look-ahead path did run
    assert any(r[2] == "stop" and r[3] in (" the", ".") for r in expected.values())
    assert_all_blocks_free(sync)
    assert_all_blocks_free(ahead)


def test_abort_with_a_step_in_flight_frees_everything():
    engine = make_engine(DEMO_MODEL_DIR, max_model_len=256)
    for i in range(3):
        engine.add_request(f"a{i}", PROMPTS[i], SamplingParams(max_tokens=40, temperature=0))
    for _ in range(6):
        engine.step()
    assert engine._inflight is not None
    engine.abort("a1")
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = out
    assert set(seen) == {"a0", "a2"} and all(len(o.outputs[0].token_ids) == 40 for o in seen.values())
    engine.step()                              # resolves whatever is still in flight
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("num_cpu_blocks", [0, 16])
def test_async_scheduling_under_block_pressure_matches_sync(num_cpu_blocks):
    """A pool too small for every sequence: the scheduler preempts (recompute, or swap to the CPU tier) behind a step
    in flight, sequences whose token is still pending included; the outputs still equal the synchronous engine's."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(DEMO_MODEL_DIR, async_scheduling=async_scheduling, max_model_len=128, num_blocks=9,
                             num_cpu_blocks=num_cpu_blocks)
        launched = []
        real = engine.runner.launch
        engine.runner.launch = lambda out, carry=None: (carry is not None and launched.append(1)) or real(out, carry)
        outs = engine.generate(PROMPTS, params)
        assert engine.scheduler.num_preemptions_total > 0 and (len(launched) > 0) == async_scheduling
        assert_all_blocks_free(engine)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


def test_async_scheduling_with_parallel_samples_matches_sync():
    """n=2: the two sequences share the prompt's blocks (copy on write behind a step in flight); every token still
    equals the synchronous engine's."""
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(DEMO_MODEL_DIR, async_scheduling=async_scheduling, max_model_len=256)
        engine.add_request("n2", PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.9, seed=5), n=2)
        engine.add_request("g", PROMPTS[0], SamplingParams(max_tokens=25, temperature=0))
        final = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = [o.token_ids for o in out.outputs]
        assert_all_blocks_free(engine)
        results.append(final)
    assert results[0] == results[1] and len(results[1]["n2"]) == 2


def test_async_scheduling_over_chunked_prefills_and_prefix_hits_matches_sync():
    """Steps of prompt chunks only (nothing sampled, nothing to carry), decodes mixed with chunks, and prompts that
    share a prefix (prefix-cache hits admitted behind a step in flight): same tokens as the synchronous engine."""
    shared = "A list of fruits: apple, banana, cherry, grape, lemon, mango, orange, peach, pear, plum. "
    prompts = [shared + p for p in PROMPTS] + [shared * 3]
    params = SamplingParams(max_tokens=12, temperature=0)
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(DEMO_MODEL_DIR, async_scheduling=async_scheduling, max_model_len=256, chunk=24)
        results.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
        assert engine.block_manager.prefix_hits > 0
        assert_all_blocks_free(engine)
    assert results[0] == results[1]


def test_host_read_sampling_still_queues_the_next_forward_first():
    """Penalties, min_tokens and grammars read the last token on the host before the next sample: that sampling is
    queued behind the next step's preparation, and the next step's forward before the last token is waited for,
    with the sync engine's outputs."""
    params = [SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0.7, seed=1, min_tokens=8),
              SamplingParams(max_tokens=16, temperature=0, structured_outputs={"regex": "[a-z]{3,9}( [a-z]{2,6})*"})]

    def run(engine) -> dict:
        for i, sp in enumerate(params):
            engine.add_request(f"r{i}", PROMPTS[i], sp)
        results = {}
        while engine.has_unfinished_requests():
            results.update({o.request_id: (o.outputs[0].token_ids, o.outputs[0].text) for o in engine.step()
                            if o.finished})
        return results

    ahead = make_engine(DEMO_MODEL_DIR, async_scheduling=True, max_model_len=256)
    events = []
    forward, apply = ahead.runner.run_step, ahead._apply
    ahead.runner.run_step = lambda prepared, carried=None: \
        events.append("forward" if carried is not None else "-") or forward(prepared, carried)
    ahead._apply = lambda out, launched, ahead=None: events.append("apply") or apply(out, launched, ahead)
    assert run(ahead) == run(make_engine(DEMO_MODEL_DIR, async_scheduling=False, max_model_len=256))
    assert "".join(e[0] for e in events).count("fa") >= 8      # forward of step N+1, then step N's tokens
    assert_all_blocks_free(ahead)


@pytest.mark.parametrize("min_tokens", [0, 12])
def test_look_ahead_forwards_no_token_past_max_tokens(min_tokens):
    """A step launched before the previous tokens land must not forward a sequence whose token in flight is its
    last (max_tokens): the forwarded count is the minimum, as in the synchronous engine."""
    params = SamplingParams(max_tokens=12, min_tokens=min_tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[2]]
    for async_scheduling in (False, True):
        engine = make_engine(DEMO_MODEL_DIR, async_scheduling=async_scheduling, max_model_len=256)
        outs = engine.generate(prompts, params)
        minimal = sum(len(o.prompt_token_ids) + params.max_tokens - 1 for o in outs)
        assert engine.runner.num_tokens_forwarded == minimal
        assert_all_blocks_free(engine)


def test_min_tokens_holds_eos_back_as_long_under_async_scheduling():
    """The row sampled behind its step (min_tokens needs its known tokens) has that step's token pending already:
    min_tokens counts the tokens the sequence has, not the one being sampled, so EOS comes as late as in sync."""
    prompt = 'What does "harbor" mean?'
    sync = make_engine(DEMO_MODEL_DIR, async_scheduling=False, max_model_len=256)
    natural = sync.generate([prompt], SamplingParams(max_tokens=64, temperature=0))[0].outputs[0].token_ids
    assert len(natural) < 60                                  # the answer ends with EOS by itself
    ahead = make_engine(DEMO_MODEL_DIR, async_scheduling=True, max_model_len=256)
    for m in (len(natural) - 1, len(natural), len(natural) + 3):
        sp = SamplingParams(max_tokens=len(natural) + 12, temperature=0, min_tokens=m)
        want = sync.generate([prompt], sp)[0].outputs[0].token_ids
        got = ahead.generate([prompt], sp)[0].outputs[0].token_ids
        assert len(want) > m and got == want, (m, len(want), len(got))
