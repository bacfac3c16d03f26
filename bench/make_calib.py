"""Build a calibration file from text on this machine or from the model itself, never from ../shared/data/val.txt.

    python bench/make_calib.py OUT.jsonl [--docstrings] [--wordnet WORDNET [--chat-model DIR]]
                                         [--samples-from MODEL_DIR [--samples N] [--sample-len L]]

Sources (default: --docstrings), one JSONL row {"text": ...} per document, the first row naming them in "source":
- `--docstrings`: the docstrings of the Python standard library (every documented module, class, function and
  method of at least 200 characters), in a fixed order: documentation prose. Depends only on the Python version.
- `--wordnet`: WordNet 3.0 glosses as dictionary entries `Word (n): gloss.` (the Debian wordnet-base .deb, e.g.
  /var/cache/apt/archives/wordnet-base_1%3a3.0-37_all.deb, or its dict directory /usr/share/wordnet), a share
  of them rendered as chat turns `What does "word" mean?` with a model's chat template (`--chat-model`).
  WordNet is not the dictionary the fixture was trained or evaluated on (GCIDE).
- `--samples-from MODEL_DIR`: N documents of L tokens sampled from the unquantized model itself (temperature 1,
  one fixed seed per sample, starting from <|endoftext|>), i.e. text from the model's own distribution without
  any corpus ("data-free" calibration). Deterministic for a given torch build and CPU.
None of them can contain a held-out document: val.txt is a split of the fixture's training corpus (the Python
documentation sources, fortunes, GCIDE), and the model never saw it. No network access.
"""
import argparse
import importlib
import inspect
import json
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# bench/ holds a kernels.py: keep this folder off sys.path so that the repository's kernels package wins
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# Modules that act on import (print, open a browser, need a display) or are internal / test-only.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
        "pydoc_data", "__hello__", "__phello__", "_pydev_bundle", "xxlimited", "xxlimited_35", "xxsubtype",
        "msilib", "winreg", "winsound", "_winapi", "nt", "msvcrt", "_msi", "_overlapped", "_wmi"}
MIN_CHARS = 200


def module_names() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP)


def documents(max_docs: int | None = None) -> list[str]:
    docs: list[str] = []
    for name in module_names():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:                 # platform-specific modules (e.g. winreg) are simply absent
                continue
            docs.extend(_module_docs(module))
        if max_docs is not None and len(docs) >= max_docs:
            return docs[:max_docs]
    return docs


def _module_docs(module) -> list[str]:
    out = []
    doc = inspect.getdoc(module)
    if doc and len(doc) >= MIN_CHARS:
        out.append(f"{module.__name__}\n\n{doc}")
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        out.extend(_doc(f"{module.__name__}.{attr}", obj))
        if inspect.isclass(obj):
            for meth, fn in sorted(vars(obj).items()):
                if not meth.startswith("_") and inspect.isfunction(fn):
                    out.extend(_doc(f"{module.__name__}.{attr}.{meth}", fn))
    return out


def _doc(title: str, obj) -> list[str]:
    doc = obj.__doc__ and inspect.cleandoc(obj.__doc__)      # own docstring only, not inherited
    return [f"{title}{_signature(obj)}\n\n{doc}"] if doc and len(doc) >= MIN_CHARS else []


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


POS = {"n": "n", "v": "v", "a": "a", "s": "a", "r": "adv"}


def wordnet_entries(path: Path, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """-> [(word, "Word (pos): gloss.")] for `count` synsets drawn with a fixed seed from WordNet's data.* files."""
    if path.suffix == ".deb":
        tmp = tempfile.mkdtemp(prefix="wordnet-")
        subprocess.run(["dpkg-deb", "-x", str(path), tmp], check=True)
        path = Path(tmp) / "usr" / "share" / "wordnet"
    lines = []
    for part in ("noun", "verb", "adj", "adv"):
        lines += [ln for ln in (path / f"data.{part}").read_text(encoding="latin-1").splitlines()
                  if ln and not ln.startswith("  ")]
    entries = []
    for line in random.Random(seed).sample(lines, min(count, len(lines))):
        fields, _, gloss = line.partition(" | ")
        parts = fields.split()
        word = parts[4].replace("_", " ")
        word = word.split("(")[0]                              # adjective markers like "big(a)"
        gloss = gloss.strip().rstrip(";")
        entries.append((word, f"{word[:1].upper()}{word[1:]} ({POS[parts[2]]}): {gloss[:1].upper()}{gloss[1:]}."))
    return entries


def chat_renderer(model_dir: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return lambda q, a: tok.apply_chat_template([{"role": "user", "content": q},
                                                 {"role": "assistant", "content": a}], tokenize=False)


def model_samples(model_dir: str, count: int, length: int, seed: int = 1000) -> list[str]:
    """Documents sampled from the model (the engine on CPU, fp32), each decoded with its special tokens."""
    from quant_serve.engine.config import CacheConfig, EngineConfig
    from quant_serve.engine.llm_engine import LLMEngine
    from quant_serve.engine.sampling_params import SamplingParams
    blocks = count * (-(-(length + 1) // 16))
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", max_model_len=length + 1,
                                    cache=CacheConfig(num_gpu_blocks=blocks)))
    tok = engine.tokenizer
    start = tok.convert_tokens_to_ids("<|endoftext|>") if "<|endoftext|>" in tok.get_vocab() else tok.eos_token_id
    params = [SamplingParams(max_tokens=length, temperature=1.0, seed=seed + i, ignore_eos=True)
              for i in range(count)]
    outputs = engine.generate([[start]] * count, params, use_tqdm=True)
    return [tok.decode(o.outputs[0].token_ids, skip_special_tokens=False) for o in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--docstrings", action="store_true", help="Python stdlib docstrings (the default source)")
    parser.add_argument("--max-docs", type=int, default=None, help="docstring documents to keep (default all)")
    parser.add_argument("--wordnet", type=Path, default=None, help="wordnet-base .deb or its dict directory")
    parser.add_argument("--wordnet-entries", type=int, default=8000)
    parser.add_argument("--chat-model", default=None, help="render a share of the entries with this chat template")
    parser.add_argument("--chat-share", type=float, default=0.3)
    parser.add_argument("--samples-from", default=None, metavar="MODEL_DIR", help="sample documents from this model")
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--sample-len", type=int, default=512)
    args = parser.parse_args()
    docs, sources = [], []
    version = ".".join(map(str, sys.version_info[:3]))
    if args.docstrings or (args.wordnet is None and args.samples_from is None):
        docs += documents(args.max_docs)
        sources.append(f"Python {version} stdlib docstrings")
    if args.samples_from is not None:
        docs += model_samples(args.samples_from, args.samples, args.sample_len)
        sources.append(f"{args.samples} samples of {args.sample_len} tokens from {Path(args.samples_from).name} "
                       f"(temperature 1, seeds 1000..{999 + args.samples}, torch {_torch_version()})")
    if args.wordnet is not None:
        chat = chat_renderer(args.chat_model) if args.chat_model else None
        rng = random.Random(1)
        for word, entry in wordnet_entries(args.wordnet, args.wordnet_entries):
            use_chat = chat is not None and rng.random() < args.chat_share
            docs.append(chat(f'What does "{word}" mean?', entry).strip("\n") if use_chat else entry)
        sources.append(f"{args.wordnet_entries} WordNet 3.0 entries ({args.wordnet.name})"
                       + (f", {args.chat_share:.0%} as chat turns" if chat else ""))
    source = " + ".join(sources)
    with args.out.open("w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            row = {"text": text} | ({"source": source} if i == 0 else {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)) / 1e6:.1f} M chars: {source}) to {args.out}")
    return 0


def _torch_version() -> str:
    import torch
    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
