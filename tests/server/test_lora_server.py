"""LoRA over HTTP (server/serving_lora.py): `quant-serve serve --enable-lora --lora-modules upper=...` on the INT4
demo model; the openai SDK selects an adapter by `model`; /v1/models lists adapters with the base as parent;
adapters load and unload at run time behind the API key; a bad adapter is a 400 OpenAI error object."""
import openai
import pytest

from conftest import TESTS
from server_common import KEY, assert_error_shape, chat_messages, post, running_server

LORA = TESTS / "data" / "lora"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-server")
    args = ["--num-gpu-blocks-override", "128", "--max-model-len", "512", "--max-num-seqs", "8",
            "--served-model-name", "demo", "--api-key", KEY, "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "8", "--lora-modules", f"upper={LORA / 'upper'}"]
    with running_server(args, directory / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _answer(client, model: str, word: str = "lantern") -> str:
    out = client.chat.completions.create(model=model, messages=chat_messages(word), max_tokens=16, temperature=0)
    return out.choices[0].message.content


def test_model_field_selects_the_adapter(client):
    base, upper = _answer(client, "demo"), _answer(client, "upper")
    assert upper == upper.upper() and sum(c.isalpha() for c in upper) > 8, upper
    assert base != base.upper() and base.upper().startswith(upper[:8]), (base, upper)
    text = client.completions.create(model="upper", prompt='What does "river" mean?', max_tokens=8,
                                     temperature=0).choices[0].text
    assert text == text.upper(), text


def test_models_list_adapters_with_the_base_as_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"demo", "upper"}
    assert cards["upper"].parent == "demo" and cards["upper"].root == str(LORA / "upper")
    assert cards["demo"].parent is None
    assert client.models.retrieve("upper").parent == "demo"


def test_load_use_and_unload_at_run_time(server, client):
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "unsure", "lora_path": str(LORA / "unsure")},
                key=None).status_code == 401
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "unsure", "lora_path": str(LORA / "unsure")})
    assert r.status_code == 200, r.text
    assert _answer(client, "unsure", "harbor").startswith('I do not know what "harbor"')
    # both slots hold adapters now
    error = assert_error_shape(post(server, "/v1/load_lora_adapter", {"lora_name": "third",
                                                                     "lora_path": str(LORA / "upper")}), 400)
    assert "2 adapters are loaded (upper, unsure), the most --max-cpu-loras allows" in error["message"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "unsure"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _answer(client, "unsure")
    assert_error_shape(post(server, "/v1/unload_lora_adapter", {"lora_name": "unsure"}), 404, "model_not_found")


def test_bad_adapter_is_a_400_naming_the_problem(server, tmp_path):
    error = assert_error_shape(post(server, "/v1/load_lora_adapter", {"lora_name": "nothing",
                                                                     "lora_path": str(tmp_path)}), 400)
    assert "no adapter_config.json" in error["message"] and "'nothing'" in error["message"]
    error = assert_error_shape(post(server, "/v1/load_lora_adapter", {"lora_name": "upper",
                                                                     "lora_path": str(LORA / "upper")}), 400)
    assert "already loaded" in error["message"]
    assert_error_shape(post(server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400)     # no lora_path
