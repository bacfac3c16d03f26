"""A SentencePiece vocabulary in a GGUF (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma, Phi-3 files) builds
the tokenizer llama.cpp tokenizes with: the file's pieces merged by score, a "▁" prefix, unknown characters as byte
tokens, <s> first. engine/load/gguf/loader.gguf_tokenizer goes through transformers' GGUF support; the reference below is
llama.cpp's SPM algorithm written out (merge the adjacent pair whose concatenation is a piece of the highest score,
leftmost first)."""
import random
from types import SimpleNamespace

import pytest

from quant_serve.engine.load.gguf.loader import gguf_tokenizer

WORDS = ["the", "cat", "sat", "on", "mat", "then", "that", "hat", "attention", "station", "nation"]


def _spm_vocab() -> tuple[list[str], list[float]]:
    """<unk> <s> </s>, 256 byte tokens, then every substring (up to 7 characters) of each "▁word" with a random
    score: many competing merges, so the merge order decides the pieces."""
    rng = random.Random(0)
    scores: dict[str, float] = {}
    for word in WORDS:
        s = "▁" + word
        for a in range(len(s)):
            for b in range(a + 1, min(len(s), a + 7) + 1):
                scores.setdefault(s[a:b], -rng.uniform(1, 10))
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + sorted(scores)
    return pieces, [0.0] * 259 + [scores[p] for p in sorted(scores)]


def _spm_reference(text: str, pieces: list[str], scores: list[float]) -> list[int]:
    ids = {p: i for i, p in enumerate(pieces)}
    syms = list("▁" + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            merged = ids.get(syms[i] + syms[i + 1])
            if merged is not None and merged > 258 and (best is None or scores[merged] > best[0]):
                best = (scores[merged], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = [1]
    for s in syms:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    pieces, scores = _spm_vocab()
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259))   # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, pieces, scores


@pytest.mark.parametrize("text", ["the cat sat on the mat", "that hat then", "attention station nation",
                                  "nationattention", "thé cat 42 ☃"])
def test_a_sentencepiece_gguf_tokenizes_as_llama_cpp(spm_gguf, text):
    path, pieces, scores = spm_gguf
    tokenizer = gguf_tokenizer(SimpleNamespace(first=path))
    ids = tokenizer.encode(text)
    assert ids == _spm_reference(text, pieces, scores), tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
