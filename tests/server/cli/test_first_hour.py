"""What a new user met in the first hour (issue 51, items 6 and 7): a model whose full context does not fit the CPU
KV pool, a GGUF tokenizer rebuilt on every start, a config with zero heads, a truncated GGUF, a port already in use,
a large /tokenize body and a log that said GPU on the CPU. Self-contained: random-weight models from a config
written here, GGUF files written here with the gguf package, the bundled demo model's tokenizer."""
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from quant_serve.engine.load.demo import DEMO_MODEL_DIR
from quant_serve.engine.load.gguf.loader import gguf_files, gguf_hf_config, gguf_tokenizer, open_gguf
from quant_serve.engine.core.long_text import encode_long
from quant_serve.server.cli.main import main

TINY_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 8192, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True, "eos_token_id": 2, "torch_dtype": "float32"}


def tiny_model(path, **changes):
    """A config (random weights: --load-format dummy) with the demo model's tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **changes}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, path / name)
    return path


def write_gguf(path, heads: int = 4, vocab: bool = True):
    """A qwen2 GGUF: hyper-parameters, the demo tokenizer as llama.cpp writes a BPE one, three small tensors."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(heads)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(8192)
    if vocab:
        tok = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text())
        added = {a["id"]: a["content"] for a in tok["added_tokens"]}
        tokens = {**{i: t for t, i in tok["model"]["vocab"].items()}, **added}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list([tokens[i] for i in range(len(tokens))])
        writer.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
        writer.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, 64)).astype(np.float32))
    q = rng.standard_normal((64, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main([*map(str, argv)])
    return code, capsys.readouterr().err


# ---- 6: the model's full context on the CPU path --------------------------------------------------------------
def test_cpu_lowers_a_default_context_that_does_not_fit_with_one_warning(tmp_path, capsys, caplog):
    model = tiny_model(tmp_path / "m")        # 1 MiB of KV: 128 blocks of 8 KiB = 2048 tokens, not 32768
    caplog.set_level(logging.INFO, "quant_serve")
    code, err = run_cli(capsys, "generate", "--model", model, "--load-format", "dummy", "--device", "cpu",
                        "--kv-cache-memory-gb", 2**-10, "--prompt", "hi", "--max-tokens", 2)
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and
                r.name.startswith("quant_serve")]
    assert len(warnings) == 1 and "max_model_len lowered from the model's 32768 to 2048" in warnings[0], warnings
    ready = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert ready and "device (cpu)" in ready[0] and "GPU" not in ready[0]       # item 7: name the device


def test_an_explicit_max_model_len_that_does_not_fit_stays_an_error(tmp_path, capsys):
    code, err = run_cli(capsys, "generate", "--model", tiny_model(tmp_path / "m"), "--load-format", "dummy",
                        "--device", "cpu", "--kv-cache-memory-gb", 2**-10, "--max-model-len", 4096, "--prompt", "hi")
    assert code == 2 and err.startswith("error: KV cache holds 2048 tokens") and err.count("\n") == 1, err


# ---- 6: the GGUF tokenizer (and config) built once ------------------------------------------------------------
def _builds(monkeypatch) -> list[str]:
    """What AutoTokenizer / AutoConfig were asked to read from a GGUF from now on."""
    import transformers
    built = []
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            if "gguf_file" in kwargs:
                built.append(klass.__name__)
            return _real(klass, *args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    return built


def _config_dict(path) -> dict:
    """The GGUF's transformers config, less where it was read from."""
    return {k: v for k, v in gguf_hf_config(open_gguf(gguf_files(path))).to_dict().items() if k != "_name_or_path"}


def test_gguf_tokenizer_and_config_are_built_once_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    first = gguf_tokenizer(open_gguf(gguf_files(path)))
    config = _config_dict(path)
    entries = sorted(p.name for p in (tmp_path / ".quant-serve").iterdir())
    assert [e.rsplit("-", 1)[0] for e in entries] == ["m.gguf.config", "m.gguf.tokenizer"], entries
    built = _builds(monkeypatch)
    again = gguf_tokenizer(open_gguf(gguf_files(path)))
    assert _config_dict(path) == config
    assert built == []                        # both from the cache
    text = "Hello world<|im_end|> 12345 café\n\n  x"
    assert again.encode(text) == first.encode(text) and again.eos_token == first.eos_token
    assert again.all_special_tokens == first.all_special_tokens
    stat = path.stat()                        # the file changes: built anew, the old entries go
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    gguf_tokenizer(open_gguf(gguf_files(path)))
    gguf_hf_config(open_gguf(gguf_files(path)))
    assert sorted(built) == ["AutoConfig", "AutoTokenizer"]
    now = sorted(p.name for p in (tmp_path / ".quant-serve").iterdir())
    assert len(now) == 2 and not set(now) & set(entries), now


def test_gguf_cache_goes_home_where_the_files_directory_is_not_writable(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf")
    (tmp_path / ".quant-serve").write_text("a file, so no directory can be made here")
    home = tmp_path / "home"
    gguf_tokenizer(open_gguf(gguf_files(path)), home)
    built = _builds(monkeypatch)
    gguf_tokenizer(open_gguf(gguf_files(path)), home)
    assert built == [] and len(list(home.glob("*/m.gguf.tokenizer-*/tokenizer.json"))) == 1


def test_gguf_cache_write_is_atomic(tmp_path, monkeypatch):
    """A save that fails midway leaves no entry (nor a temporary directory) that a later start would trust."""
    path = write_gguf(tmp_path / "m.gguf")
    from transformers import PreTrainedTokenizerBase

    def half_save(self, directory, *args, **kwargs):
        (Path(directory) / "tokenizer.json").write_text("{")
        raise OSError("disk full")
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", half_save)
    tok = gguf_tokenizer(open_gguf(gguf_files(path)), tmp_path / "home")
    assert tok.encode("hello") and not list((tmp_path / ".quant-serve").iterdir())
    assert not list((tmp_path / "home").rglob("*tokenizer*"))


# ---- 7: one-line errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("num_key_value_heads", 0), ("head_dim", 0),
                                         ("hidden_size", 0), ("num_hidden_layers", None), ("vocab_size", "8192")])
def test_config_sizes_are_checked_by_name(tmp_path, capsys, field, value):
    code, err = run_cli(capsys, "generate", "--model", tiny_model(tmp_path / "m", **{field: value}),
                        "--load-format", "dummy", "--prompt", "hi")
    assert code == 2 and err.count("\n") == 1, err
    assert f"config.json: {field} must be a positive integer, got {json.dumps(value)}" in err


def test_gguf_with_zero_heads_names_the_key(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", heads=0, vocab=False)
    code, err = run_cli(capsys, "generate", "--model", path, "--prompt", "hi")
    assert code == 2 and err == f"error: {path}: qwen2.attention.head_count must be a positive integer, got 0\n"


@pytest.mark.parametrize("keep,says", [(0, "is empty"), (10, "ends inside the GGUF header"),
                                       (200, "metadata runs past the end of the file (key"),
                                       (-9000, "tensor 'token_embd.weight'"), (-300, "tensor 'blk.0.attn_q.weight'"),
                                       (-1, "tensor 'output_norm.weight'")])
def test_truncated_gguf_is_named_not_a_numpy_error(tmp_path, capsys, keep, says):
    data = write_gguf(tmp_path / "whole.gguf", vocab=False).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    code, err = run_cli(capsys, "generate", "--model", path, "--prompt", "hi")
    assert code == 2 and err.startswith(f"error: {path} is ") and says in err and err.count("\n") == 1, err
    assert "truncated" in err or "empty" in err
    assert not any(w in err for w in ("dtype", "reshape", "out of bounds")), err


def test_corrupt_gguf_names_the_problem(tmp_path, capsys):
    data = bytearray(write_gguf(tmp_path / "whole.gguf", vocab=False).read_bytes())
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    code, err = run_cli(capsys, "generate", "--model", tmp_path / "zip.gguf", "--prompt", "hi")
    assert code == 2 and "is not a GGUF file" in err, err
    data[24 + 8 + len("general.architecture")] = 99        # the first key's value type
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    code, err = run_cli(capsys, "generate", "--model", tmp_path / "bad.gguf", "--prompt", "hi")
    assert code == 2 and "'general.architecture' has unknown value type 99" in err, err


@pytest.mark.parametrize("replicas", [0, 2])
def test_port_in_use_is_found_before_the_model_loads(tmp_path, capsys, replicas):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]      # the model does not exist: its error would come first if it loaded first
        code, err = run_cli(capsys, "serve", tmp_path / "no-model", "--port", port, "--replicas", replicas)
    assert code == 2 and err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and "--port" in err, err


# ---- 7: /tokenize memory bounded by the body -------------------------------------------------------------------
def _mixed_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    parts = ["hello", " world", "it's", "x2", "3.14", "café", "e\u0301", "日本語", "  ", "\n", "\n\n", "!!", "(a)",
             "12345678", "<|im_end|>", "<|endoftext|>", "\t", "🙂", "—", "ab12cd", " "]
    return "".join(rng.choice(parts) if rng.random() < 0.6 else chr(rng.randrange(32, 127)) for _ in range(n))


def test_long_text_in_pieces_gives_the_ids_of_the_whole(tmp_path):
    from tokenizers import Tokenizer, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    byte_level = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    backend = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))   # a prefix added to every text:
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    prefixed = PreTrainedTokenizerFast(tokenizer_object=backend)             # no cut may be made inside words
    for tokenizer in (byte_level, prefixed):
        for seed in range(6):
            text = _mixed_text(3000, seed)
            for special in (True, False):
                assert encode_long(tokenizer, text, special, piece_chars=64) == \
                    tokenizer.encode(text, add_special_tokens=special), (seed, special)


RSS_SCRIPT = textwrap.dedent("""
    import json, random, resource, sys
    from fastapi.testclient import TestClient
    from quant_serve.engine.config import CacheConfig, EngineConfig
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.server.app import build_app
    engine = LLMEngine(EngineConfig(model=sys.argv[1], load_format="dummy", device="cpu", max_model_len=1024,
                                    cache=CacheConfig(num_gpu_blocks=64)), show_progress=False)
    rng = random.Random(0)
    text = "".join(chr(rng.randrange(33, 127)) for _ in range(1_000_000))   # ~1 token a byte
    with TestClient(build_app(engine, ["m"])) as client:
        assert client.post("/tokenize", json={"prompt": "warm up"}).status_code == 200
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        answer = client.post("/tokenize", content=json.dumps({"prompt": text}),
                             headers={"content-type": "application/json"})
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    same = answer.json()["tokens"] == engine.tokenizer.encode(text)
    print(json.dumps({"status": answer.status_code, "grown_mib": round(grown / 1024), "same": same}))
""")


def test_tokenize_memory_is_bounded_by_the_body(tmp_path):
    """1 MB of text is ~1M tokens: encoded whole the tokenizer held +300 MiB (1.9 MB: +590); in pieces ~+30."""
    model = tiny_model(tmp_path / "m")
    run = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["status"] == 200 and result["same"], result
    assert result["grown_mib"] < 100, result
