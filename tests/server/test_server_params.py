"""Parameters the server does not implement are a 400 naming them (never ignored), unknown roles are a 400, and
logit_bias steers the sampler, per request within one batch. Against the shared real server."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_common import assert_error_shape, chat_messages, post

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.mark.parametrize("path, extra, param", [
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"no_such_field": 1}, "no_such_field"),
    (COMPLETIONS, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/tokenize", {"frobnicate": True}, "frobnicate"),
])
def test_unimplemented_parameters_are_400_naming_them(server, path, extra, param):
    body = {"messages": chat_messages(), "max_tokens": 2} if path == CHAT else {"prompt": "hello"}
    if path == COMPLETIONS:
        body["max_tokens"] = 2
    error = assert_error_shape(post(server, path, {**body, **extra}), 400)
    assert error["param"] == param and param.split(".")[-1] in error["message"], error


def test_values_that_ask_for_nothing_are_accepted(server):
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "user": "u1", "store": False,
               "parallel_tool_calls": True, "metadata": {"k": "v"}, "service_tier": "auto"}
    response = post(server, CHAT, {"messages": chat_messages(), "max_tokens": 2, **neutral})
    assert response.status_code == 200, response.text


def test_openai_client_sees_the_parameter(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=2,
                                       modalities=["text", "audio"])
    assert e.value.body["param"] == "modalities"


def test_unknown_role_is_400(server):
    messages = [{"role": "wizard", "content": "Cast a spell"}]
    error = assert_error_shape(post(server, CHAT, {"messages": messages, "max_tokens": 2}), 400)
    assert error["param"] == "messages.0.role", error
    developer = [{"role": "developer", "content": "Be brief."}, *chat_messages()]
    assert post(server, CHAT, {"messages": developer, "max_tokens": 2}).status_code == 200


def _token_id(server, text: str) -> int:
    ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def _greedy(server, **extra) -> str:
    body = {"prompt": "The Python documentation", "max_tokens": 3, "temperature": 0, "ignore_eos": True, **extra}
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_logit_bias_changes_the_chosen_token(server):
    first = _greedy(server, max_tokens=1)
    banned = _token_id(server, first)
    assert _greedy(server, max_tokens=1, logit_bias={str(banned): -100}) != first
    forced = _token_id(server, " water")
    assert _greedy(server, logit_bias={str(forced): 100}) == " water" * 3
    # beyond +-100 is clamped (OpenAI's range), not refused
    assert _greedy(server, logit_bias={str(forced): 1e6}) == " water" * 3
    # sampled rows take the bias too
    assert _greedy(server, temperature=1.0, seed=3, logit_bias={str(forced): 100}) == " water" * 3


def test_logit_bias_is_per_request_in_one_batch(server):
    words = [" river", " stone", " cloud", None]
    biases = [{str(_token_id(server, w)): 100} if w else None for w in words]
    plain = _greedy(server)
    with ThreadPoolExecutor(len(words)) as pool:
        texts = list(pool.map(lambda b: _greedy(server, max_tokens=24, **({"logit_bias": b} if b else {})), biases))
    assert texts[:3] == [word * 24 for word in words[:3]]
    assert texts[3].startswith(plain), "the request without a bias is not steered by its neighbours'"


@pytest.mark.parametrize("bias", [{"abc": 1}, {"999999": 1}, {"-1": 1}, {"5": "high"}])
def test_bad_logit_bias_is_400(server, bias):
    error = assert_error_shape(post(server, COMPLETIONS, {"prompt": "x", "max_tokens": 1, "logit_bias": bias}), 400)
    assert error["param"].startswith("logit_bias"), error


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"prompt": "x", "n": 2.0}, "n"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "echo": 1}, "echo"),
    ("/detokenize", {"tokens": [True]}, "tokens.0"),
])
def test_types_are_checked_strictly_as_openai_does(server, path, body, param):
    error = assert_error_shape(post(server, path, body), 400)
    assert error["param"] == param, error
