"""GGUF repositories on the hub: `org/name:QUANT` picks one quantization's file or split parts, offline from the
local hub cache too; an unknown tag names the ones the repository has."""
import shutil

import pytest

from quant_serve.engine.load.gguf.hub import available_quants, select_gguf_files, split_quant_tag
from quant_serve.engine.load.loader import resolve_model_dir
from quant_serve.engine.sampling_params import SamplingParams

from gguf_fixtures import write_gguf
from helpers import make_engine

REPO_FILES = ["README.md", "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf",
              "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf", "qwen2.5-7b-instruct-q4_k_s.gguf",
              "qwen2.5-7b-instruct-q8_0.gguf", "Q5_K_M/Model-Q5_K_M-00001-of-00002.gguf",
              "Q5_K_M/Model-Q5_K_M-00002-of-00002.gguf", "llama-2-7b.Q4_K.gguf", "Model-IQ4_XS.gguf",
              "mmproj-Model-F16.gguf"]


def test_tags_select_one_file_or_one_split_set():
    assert split_quant_tag("org/name:Q4_K_M") == ("org/name", "Q4_K_M")
    assert split_quant_tag("org/name") == ("org/name", None)
    assert split_quant_tag("a/b/c:Q4_0") == ("a/b/c:Q4_0", None)
    assert select_gguf_files(REPO_FILES, "Q4_K_M") == REPO_FILES[1:3]
    assert select_gguf_files(REPO_FILES, "q8_0") == ["qwen2.5-7b-instruct-q8_0.gguf"]
    assert select_gguf_files(REPO_FILES, "Q5_K_M") == REPO_FILES[5:7]          # parts in a sub-folder
    assert select_gguf_files(REPO_FILES, "Q4_K") == ["llama-2-7b.Q4_K.gguf"]   # not Q4_K_M or Q4_K_S
    assert select_gguf_files(REPO_FILES, "iq4_xs") == ["Model-IQ4_XS.gguf"]
    assert available_quants(REPO_FILES) == ["IQ4_XS", "Q4_K", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q8_0"]
    with pytest.raises(ValueError, match=r"'Q2_K'.*IQ4_XS, Q4_K, Q4_K_M, Q4_K_S, Q5_K_M, Q8_0"):
        select_gguf_files(REPO_FILES, "Q2_K")
    with pytest.raises(ValueError, match="lacks qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf"):
        select_gguf_files(REPO_FILES[:2], "Q4_K_M")


def test_quant_tag_loads_from_the_offline_hub_cache(tmp_path, monkeypatch, random_model):
    import huggingface_hub.constants as hub
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--someone--tiny-GGUF"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    original = write_gguf(random_model, tmp_path / "tiny-Q4_0.gguf", "Q4_0")
    shutil.copy(original, snapshot / "tiny-Q4_0.gguf")
    (snapshot / "tiny-Q8_0.gguf").write_bytes(b"never read")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))

    assert resolve_model_dir("someone/tiny-GGUF:q4_0") == snapshot / "tiny-Q4_0.gguf"
    with pytest.raises(ValueError, match=r"'Q2_K'.*\(it has: Q4_0, Q8_0\)"):
        resolve_model_dir("someone/tiny-GGUF:Q2_K")
    with pytest.raises(RuntimeError, match=r"someone/other-GGUF on the hub \(OfflineModeIsEnabled.*local hub cache"):
        resolve_model_dir("someone/other-GGUF:Q4_0")
    params = SamplingParams(max_tokens=8, temperature=0)
    served = make_engine("someone/tiny-GGUF:Q4_0").generate(["The meaning of the word"], params)
    direct = make_engine(original).generate(["The meaning of the word"], params)
    assert served[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
