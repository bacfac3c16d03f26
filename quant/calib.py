"""Calibration text for the quantizers: documents from a file, cut into token windows. (The forward they calibrate
on is the engine's decoder, seen through quant/block.py's protocol.)"""
import json
import random
from pathlib import Path
from typing import Callable

import torch

EOT = "<|endoftext|>"


# ---- calibration text --------------------------------------------------------------------------------------

def read_calib_file(path: str | Path) -> list[str]:
    """Documents from a file: JSONL with a "text" field, or plain text split on `<|endoftext|>` (when present)
    or on blank lines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    raw = path.read_text(encoding="utf-8", errors="replace")
    first = raw.lstrip()[:1]
    if path.suffix == ".jsonl" or first == "{":
        docs = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e}); use JSONL with a \"text\" field") from e
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n}: JSONL calibration rows need a \"text\" string field")
            docs.append(row["text"])
    else:
        parts = raw.split(EOT) if EOT in raw else raw.split("\n\n")
        docs = [p.strip("\n") for p in parts]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"calibration file {path} holds no text")
    return docs


def calib_tokens(docs: list[str], encode: Callable[[str], list[int]], num_samples: int, seq_len: int,
                 separator: list[int] = (), seed: int = 0) -> torch.Tensor:
    """Documents -> [S, L] int64: shuffled (fixed seed), joined by `separator` token ids, cut into S windows of L
    tokens (AutoAWQ style). S = num_samples, or fewer when the text is short (at least one full window)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    ids: list[int] = []
    need = num_samples * seq_len
    for i in order:
        ids.extend(encode(docs[i]))
        ids.extend(separator)
        if len(ids) >= need:
            break
    n = min(num_samples, len(ids) // seq_len)
    if n < 1:
        raise ValueError(f"calibration text has only {len(ids)} tokens, fewer than one window of {seq_len}; "
                         "pass more text or a smaller --calib-seq-len")
    return torch.tensor(ids[:n * seq_len], dtype=torch.int64).view(n, seq_len)
