"""Fuzz every operation of the server's OpenAPI schema (schemathesis, deterministic, a bounded number of cases):
no 5xx, every 4xx is an OpenAI error object (never FastAPI's 422), and invalid bodies get a 400."""
import pytest
import requests

from server_common import running_server

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (it is in the `test` extra)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

MAX_EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}


@pytest.fixture(scope="module")
def server(tmp_path_factory, random_model):
    # A short context, few sequences and a small random model keep the fuzzed generations cheap.
    args = [str(random_model), "--num-gpu-blocks-override", "64", "--max-model-len", "48", "--max-num-seqs", "4",
            "--dtype", "float32"]
    with running_server(args, tmp_path_factory.mktemp("schema") / "server.log") as s:
        yield s


def operations(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_fuzz_gives_no_server_errors(server):
    ops = operations(server)
    labels = {op.label for op in ops}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"} <= labels
    session = requests.Session()
    seen: dict[str, set[int]] = {}

    # positive: valid per the schema (they reach the engine); negative: invalid bodies (they must get a 400)
    cases = [(mode, op) for mode in MAX_EXAMPLES for op in ops
             if mode == GenerationMode.POSITIVE or op.method.lower() == "post"]
    for mode, op in cases:
        @settings(max_examples=MAX_EXAMPLES[mode], derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(session=session, timeout=60)
            seen.setdefault((mode, op.label), set()).add(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])
            assert response.status_code != 422, response.text[:500]
            if response.status_code >= 400:
                error = response.json()["error"]
                assert {"message", "type", "param", "code"} <= set(error), response.text[:500]

        check()
        if mode == GenerationMode.NEGATIVE:
            assert seen[(mode, op.label)] <= {400, 404}, (op.label, seen[(mode, op.label)])
    # the fuzzing reached the engine, not only the validators
    positive = GenerationMode.POSITIVE
    assert 200 in seen[(positive, "POST /v1/completions")] | seen[(positive, "POST /v1/chat/completions")], seen
    assert server.pool_is_whole()
