"""The README's first command: `quant-serve serve` with no MODEL serves the bundled INT4 demo model."""
import json

import httpx

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from server_common import running_server


def test_demo_model_is_bundled_awq():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["version"]) == ("awq", 4, 128, "gemm")
    size = (DEMO_MODEL_DIR / "model.safetensors").stat().st_size
    assert 15e6 < size < 25e6, "the demo model is the INT4 tiny-qwen2 (about 20 MB)"


def test_serve_with_no_model_answers_a_definition(tmp_path):
    with running_server(["--num-gpu-blocks-override", "512"], tmp_path / "server.log") as server:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["quant-serve-demo"]
        body = {"model": "quant-serve-demo", "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": 'What does "lantern" mean?'}]}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        text = reply["choices"][0]["message"]["content"]
        assert text.lower().startswith("lantern ("), text       # the fixture's dictionary style: "word (pos): ..."
        assert "awq gemm, 4-bit, group 128" in server.log()
