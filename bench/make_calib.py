"""Build a calibration file from text already on this machine: the docstrings of the Python standard library.

    python bench/make_calib.py OUT.jsonl [--max-docs N]

One JSONL row {"text": ...} per documented module, class or function (at least 200 characters), in a fixed
order, so the file depends only on the Python version (recorded in the first row's "source" field). This is
Python-documentation prose, the largest part of what the fixture model was trained on, and shares no document
with ../shared/data/val.txt (which comes from the Python documentation *sources*, fortunes and a dictionary; the
held-out split is never used for calibration). No network access.
"""
import argparse
import importlib
import inspect
import json
import sys
import warnings
from pathlib import Path

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-docs", type=int, default=None)
    args = parser.parse_args()
    docs = documents(args.max_docs)
    version = ".".join(map(str, sys.version_info[:3]))
    with args.out.open("w", encoding="utf-8") as f:
        for i, text in enumerate(docs):
            row = {"text": text} | ({"source": f"Python {version} stdlib docstrings"} if i == 0 else {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)) / 1e6:.1f} M chars, Python {version}) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
