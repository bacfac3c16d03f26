import random

import pytest
from transformers import AutoTokenizer

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.core.detokenizer import IncrementalDetokenizer
from quant_serve.engine.sampling_params import SamplingParams

MODEL = DEMO_MODEL_DIR               # tiny-qwen2's tokenizer
PROMPT = [1, 872, 198]       # "<|im_start|>" + a couple of ordinary tokens


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


def stream(tok, ids, prompt=PROMPT, chunks=None, **params):
    """Feed ids (in chunks of the given sizes, default one token) and return (deltas, finish text, detok)."""
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    deltas, matched, i = [], None, 0
    for size in chunks or [1] * len(ids):
        delta, m = detok.add_tokens(ids[i:i + size])
        i += size
        deltas.append(delta)
        matched = matched or m
        if m is not None:
            assert detok.output_text == "".join(deltas)
    assert matched == detok.matched_stop
    return deltas, detok.finish(), detok


def random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 4), n - sum(sizes)))
    return sizes


def test_multibyte_characters_are_held_until_complete(tok):
    text = "héllo wörld 日本語 🙂"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)      # the fixture really splits characters
    deltas, tail, detok = stream(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == text == detok.output_text
    # a step that ends inside a character emits nothing; the next one emits the whole character
    first_split = next(j for j, i in enumerate(ids) if tok.decode([i]) == "\ufffd")
    assert deltas[first_split] == "" and deltas[first_split + 1].startswith("é")


def test_random_token_sequences_match_full_decode(tok):
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        skip = trial % 2 == 0
        deltas, tail, detok = stream(tok, ids, chunks=random_chunks(rng, len(ids)), skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == expected == detok.output_text, (ids, skip)
        assert not any(d.endswith("\ufffd") for d in deltas)       # broken characters are never streamed


def test_random_multilingual_text_streams_without_replacement_chars(tok):
    rng = random.Random(1)
    pool = list("abc xyz.,!?") + list("éöüßñç") + list("日本語中文한국어") + ["🙂", "🚀", "👍🏽", "\n"]
    for _ in range(100):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        ids = tok.encode(text)
        deltas, tail, _ = stream(tok, ids, chunks=random_chunks(rng, len(ids)))
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + tail == text == tok.decode(ids)


def test_special_tokens_respect_skip_flag(tok):
    ids = tok.encode("Hi there") + [2] + tok.encode(" ok") + [0]
    for skip, expected in [(True, "Hi there ok"), (False, "Hi there<|im_end|> ok<|endoftext|>")]:
        deltas, tail, _ = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == expected


def test_prompt_ending_inside_a_character_does_not_leak_into_output(tok):
    e_acute = tok.encode("é")          # two byte tokens
    assert len(e_acute) == 2
    out = [e_acute[1]] + tok.encode("la")
    deltas, tail, _ = stream(tok, out, prompt=PROMPT + [e_acute[0]])
    assert "".join(deltas) + tail == tok.decode(out) == "\ufffdla"


def test_decode_windows_stay_small(tok):
    calls = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 40)
    assert len(ids) > 300
    deltas, tail, _ = stream(Counting(), ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    assert max(calls) <= 8


def test_stop_string_truncates_and_holds_back_partial_matches(tok):
    text = "Hello wonderful world. Bye"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams(stop=["world"]))
    decoded = ""
    for j, i in enumerate(ids):
        delta, matched = detok.add_tokens([i])
        if matched is None:
            decoded = tok.decode(ids[:j + 1])
            # exactly len("world") - 1 characters are held back
            assert detok.output_text == decoded[:max(0, len(decoded) - 4)]
        else:
            assert matched == "world"
            assert detok.output_text == "Hello wonderful "
            break
    else:
        pytest.fail("stop string not matched")
    assert detok.add_tokens(tok.encode(" more")) == ("", None)
    assert detok.finish() == ""
    assert detok.output_text == "Hello wonderful "


def test_stop_string_include_in_output(tok):
    ids = tok.encode("Hello wonderful world. Bye")
    deltas, tail, detok = stream(tok, ids, stop=["world"], include_stop_str_in_output=True)
    assert detok.matched_stop == "world"
    assert "".join(deltas) + tail == detok.output_text == "Hello wonderful world"


def test_stop_string_inside_one_chunk_drops_the_rest(tok):
    ids = tok.encode("Hello world. Goodbye")
    for include, expected in [(False, "Hello world"), (True, "Hello world.")]:
        deltas, tail, detok = stream(tok, ids, chunks=[len(ids)], stop=["."], include_stop_str_in_output=include)
        assert deltas == [expected] and tail == "" and detok.matched_stop == "."


def test_first_completed_stop_string_wins_and_may_start_mid_token(tok):
    ids = tok.encode("abcdef ghij")
    for chunks in [None, [len(ids)]]:       # token by token, and all tokens in one call
        deltas, tail, detok = stream(tok, ids, chunks=chunks, stop=["def", "bcd", "gh"])
        assert detok.matched_stop == "bcd"
        assert "".join(deltas) + tail == "a"
        # "bc" is complete before "abcd", even though "abcd" starts earlier
        deltas, tail, detok = stream(tok, ids, chunks=chunks, stop=["abcd", "bc"], include_stop_str_in_output=True)
        assert detok.matched_stop == "bc"
        assert "".join(deltas) + tail == "abc"


def test_unmatched_stop_string_releases_held_text_at_finish(tok):
    text = "héllo wörld 日本語 🙂"
    ids = tok.encode(text)
    deltas, tail, detok = stream(tok, ids, stop=["🙂!", "wörlds"])
    assert detok.matched_stop is None
    assert "".join(deltas) == text[:len(text) - 5]
    assert tail == text[len(text) - 5:]
    assert detok.output_text == text


def test_stop_strings_on_random_text_match_reference(tok):
    rng = random.Random(2)
    pool = list("ab c") + ["é", "日", "🙂"]
    for _ in range(200):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 25)))
        stops = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 3))) for _ in range(2)]
        include = rng.random() < 0.5
        ids = tok.encode(text)
        deltas, tail, detok = stream(tok, ids, chunks=random_chunks(rng, len(ids)), stop=stops,
                                     include_stop_str_in_output=include)
        # reference: the first position where a stop string is complete, over the full text
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            end, start, stop = min(hits)
            expected = text[:end] if include else text[:start]
            assert detok.matched_stop == stop
        else:
            expected = text
            assert detok.matched_stop is None
        assert "".join(deltas) + tail == detok.output_text == expected, (text, stops, include)


def test_backend_decode_equals_the_tokenizer_wrapper(tok):
    """The detokenizer calls the fast tokenizer's Rust backend directly; it must return what decode() does."""
    rng = random.Random(1)
    detok = IncrementalDetokenizer(tok, PROMPT, SamplingParams())
    assert detok._backend is not None
    for trial in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
        detok.skip_special_tokens = trial % 2 == 0
        assert detok._decode(ids) == tok.decode(ids, skip_special_tokens=detok.skip_special_tokens,
                                                clean_up_tokenization_spaces=False)
