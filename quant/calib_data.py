"""Calibration text that needs no download: Python standard-library docstrings and WordNet glosses, and the JSONL
file `quant-serve make-calib` writes (one {"text": ...} row per document, the first row naming its sources in
"source"). Text sampled from the model itself is engine/calib_samples.py's (it needs the engine).

Neither source can contain a held-out document of the fixture: val.txt is a split of its training corpus (the
Python documentation sources, fortunes, GCIDE), and the docstrings and WordNet are other texts.
"""
import importlib
import inspect
import json
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# Modules that act on import (print, open a browser, need a display) or are internal / test-only.
SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
                "pydoc_data", "__hello__", "__phello__", "_pydev_bundle", "xxlimited", "xxlimited_35", "xxsubtype",
                "msilib", "winreg", "winsound", "_winapi", "nt", "msvcrt", "_msi", "_overlapped", "_wmi"}
MIN_DOC_CHARS = 200
WORDNET_POS = {"n": "n", "v": "v", "a": "a", "s": "a", "r": "adv"}


# ---- Python standard-library docstrings ----------------------------------------------------------------------

def stdlib_module_names() -> list[str]:
    return sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)


def docstring_documents(max_docs: int | None = None) -> list[str]:
    """Every documented stdlib module, class, function and method with a docstring of at least MIN_DOC_CHARS
    characters, as `title(signature)\\n\\ndocstring`, in a fixed order. Depends only on the Python version."""
    docs: list[str] = []
    for name in stdlib_module_names():
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
    if doc and len(doc) >= MIN_DOC_CHARS:
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
    return [f"{title}{_signature(obj)}\n\n{doc}"] if doc and len(doc) >= MIN_DOC_CHARS else []


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


# ---- WordNet glosses -----------------------------------------------------------------------------------------

def wordnet_entries(path: str | Path, count: int, seed: int = 0) -> list[tuple[str, str]]:
    """-> [(word, "Word (pos): gloss.")] for `count` synsets drawn with a fixed seed from WordNet 3.0's data.*
    files: the Debian wordnet-base .deb (`apt-get download wordnet-base`) or its dict directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"WordNet {path} does not exist (a wordnet-base .deb or its dict directory)")
    if path.suffix == ".deb":
        tmp = tempfile.mkdtemp(prefix="wordnet-")
        try:
            subprocess.run(["dpkg-deb", "-x", str(path), tmp], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise ValueError(f"cannot unpack {path} with dpkg-deb ({e}); pass the unpacked dict directory "
                             "(/usr/share/wordnet) instead") from e
        path = Path(tmp) / "usr" / "share" / "wordnet"
    lines = []
    for part in ("noun", "verb", "adj", "adv"):
        data = path / f"data.{part}"
        if not data.is_file():
            raise FileNotFoundError(f"{data} is missing: {path} is not a WordNet dict directory")
        lines += [ln for ln in data.read_text(encoding="latin-1").splitlines() if ln and not ln.startswith("  ")]
    entries = []
    for line in random.Random(seed).sample(lines, min(count, len(lines))):
        fields, _, gloss = line.partition(" | ")
        parts = fields.split()
        word = parts[4].replace("_", " ").split("(")[0]          # adjective markers like "big(a)"
        gloss = gloss.strip().rstrip(";")
        entries.append((word, f"{word[:1].upper()}{word[1:]} ({WORDNET_POS[parts[2]]}): "
                              f"{gloss[:1].upper()}{gloss[1:]}."))
    return entries


# ---- the file ------------------------------------------------------------------------------------------------

def write_calib_jsonl(path: str | Path, docs: list[str], source: str) -> None:
    """One {"text": ...} row per document; the first row also names the sources."""
    if not docs:
        raise ValueError("no calibration documents to write")
    with Path(path).open("w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            row = {"text": text} | ({"source": source} if i == 0 else {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
