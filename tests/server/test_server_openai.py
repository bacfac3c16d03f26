"""The OpenAI-compatible server through the official openai SDK, against a real `quant-serve serve` process."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_common import chat_messages, post

GREEDY = {"temperature": 0.0}
LONG = {"ignore_eos": True}      # extra_body: keeps the token count fixed


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_startup_log_and_models(server, client):
    log = server.log()
    assert "unquantized" in log
    assert "KV cache: 4096 tokens, max concurrency 8.0 at 512 tokens" in log
    assert "memory: weights" in log
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_stream_matches_non_stream(client):
    kw = dict(model="tiny-alias", prompt="The Python documentation", max_tokens=24, extra_body=LONG, **GREEDY)
    full = client.completions.create(**kw)
    assert full.model == "tiny-alias" and full.usage.completion_tokens == 24
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *content, last = chunks
    assert all(len(c.choices) == 1 and c.usage is None for c in content)
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == full.usage.prompt_tokens > 0


def test_chat_stream_opens_with_the_role(server, client):
    kw = dict(model="tiny", messages=chat_messages(), max_tokens=32, **GREEDY)
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    prompt_ids = post(server, "/tokenize", {"messages": chat_messages()}).json()["tokens"]
    assert full.usage.prompt_tokens == len(prompt_ids)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *content, last = chunks
    deltas = [c.choices[0].delta for c in content]
    assert (deltas[0].role, deltas[0].content) == ("assistant", ""), "the role first, with empty content (as OpenAI)"
    assert content[0].choices[0].finish_reason is None and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == message.content
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert last.choices == [] and all(c.usage is None for c in content)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_n2_seeded_sampling(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=16, n=2, temperature=1.0, seed=7, extra_body=LONG)
    first = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "the two samples must use different random streams"
    assert first.usage.completion_tokens == 32
    again = client.completions.create(**kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts, "same seed, same samples"
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == texts

    chat = client.chat.completions.create(model="tiny", messages=chat_messages("river"), max_tokens=12, n=2,
                                          temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    # a prompt list: choice index = prompt index * n + sample index
    multi = client.completions.create(model="tiny", prompt=["A", "B"], max_tokens=2, n=2, **GREEDY)
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]


def test_stop_strings(client):
    prompt = "The Python documentation"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, extra_body=LONG, **GREEDY)
    text = full.choices[0].text
    middle = len(text) // 2
    stop = text[middle:middle + 3]
    assert stop.strip(), text
    expected = text[:text.index(stop)]
    kw = dict(model="tiny", prompt=prompt, max_tokens=32, stop=[stop, "never-there"], extra_body=LONG, **GREEDY)
    cut = client.completions.create(**kw)
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)) == expected
    kept = client.completions.create(**{**kw, "extra_body": {**LONG, "include_stop_str_in_output": True}})
    assert kept.choices[0].text == expected + stop

    chat_full = client.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=32, **GREEDY)
    content = chat_full.choices[0].message.content
    stop = content[len(content) // 2:len(content) // 2 + 2]
    chat_cut = client.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=32, stop=stop,
                                              **GREEDY)
    assert chat_cut.choices[0].message.content == content[:content.index(stop)]
    assert chat_cut.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    resp = client.completions.create(model="tiny", prompt="The Python documentation", max_tokens=8, logprobs=3,
                                     extra_body=LONG, **GREEDY)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 8
    assert "".join(lp.tokens) == choice.text
    offset = 0
    for token, value, top, start in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert start == offset
        offset += len(token)
        assert value <= 0 and top[token] == value
        assert len(top) == 3 and value == max(top.values()), "greedy: the chosen token is the best one"


def test_echo_logprobs_for_scoring(server):
    """What lm-eval's local-completions sends for loglikelihood, and what it reads back."""
    ids = post(server, "/tokenize", {"prompt": "The Python documentation is"}).json()["tokens"]
    base = {"model": "tiny", "temperature": 0, "logprobs": 1, "seed": 1234}
    gen = post(server, "/v1/completions", {**base, "prompt": ids, "max_tokens": 1}).json()["choices"][0]
    next_token_lp = gen["logprobs"]["token_logprobs"][0]

    echo = post(server, "/v1/completions", {**base, "prompt": [ids], "max_tokens": 1, "echo": True}).json()
    lp = echo["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1           # the prompt, then the generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["token_logprobs"][-1] == pytest.approx(next_token_lp, abs=1e-4)
    assert echo["choices"][0]["text"].startswith("The Python documentation is")

    # max_tokens=0: the prompt only; scoring prompt + greedy token gives that token's logprob at the end
    token_id = post(server, "/tokenize", {"prompt": gen["text"]}).json()["tokens"]
    assert len(token_id) == 1, gen
    scored = post(server, "/v1/completions", {**base, "prompt": ids + token_id, "max_tokens": 0, "echo": True})
    choice = scored.json()["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(next_token_lp, abs=1e-4)
    assert choice["logprobs"]["token_logprobs"][:-1] == pytest.approx(lp["token_logprobs"][:-1], abs=1e-4)
    assert scored.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"


def test_chat_logprobs_stream_and_usage(client):
    kw = dict(model="tiny", messages=chat_messages("bridge"), max_tokens=8, logprobs=True, top_logprobs=2,
              extra_body=LONG, **GREEDY)
    full = client.chat.completions.create(**kw)
    entries = full.choices[0].logprobs.content
    assert len(entries) == full.usage.completion_tokens == 8
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.logprob == e.top_logprobs[0].logprob
        assert e.bytes == list(e.token.encode())
    streamed = []
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []    # none in the role chunk, as OpenAI
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert usage.completion_tokens == len(streamed)


def test_concurrent_streams_interleave(client):
    prompts = [f'What does "{w}" mean?' for w in ("apple", "river", "stone", "cloud", "music", "window")]
    kw = dict(model="tiny", max_tokens=40, extra_body=LONG, **GREEDY)
    with ThreadPoolExecutor(6) as pool:
        expected = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
    barrier = threading.Barrier(len(prompts))

    def stream(prompt):
        barrier.wait()
        times, text = [], ""
        for chunk in client.completions.create(prompt=prompt, stream=True, **kw):
            times.append(time.monotonic())
            text += chunk.choices[0].text
        return times, text

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(stream, prompts))
    assert [text for _, text in results] == expected
    # every stream got its first chunk before any stream finished: they ran side by side
    assert max(times[0] for times, _ in results) < min(times[-1] for times, _ in results)


def test_best_of_returns_the_most_likely_of_its_samples(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, extra_body=LONG)
    samples = client.completions.create(n=3, logprobs=0, **kw).choices
    totals = [sum(c.logprobs.token_logprobs) for c in sorted(samples, key=lambda c: c.index)]
    best = client.completions.create(n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == sorted(samples, key=lambda c: c.index)[totals.index(max(totals))].text
    assert len({c.text for c in samples}) > 1, "the samples differ, so the choice among them matters"
