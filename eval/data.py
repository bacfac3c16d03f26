"""Held-out text -> token ids -> scoring windows (the perplexity protocol of docs/targets.md)."""
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Window:
    """A slice of the token stream scored in one forward pass. Tokens before `first_scored` are context only
    (already scored by the previous window when windows overlap); the first token never has a prediction."""
    start: int                 # offset of tokens[0] in the whole stream
    tokens: list[int]
    first_scored: int          # index in `tokens` of the first predicted token, >= 1

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.first_scored

    @property
    def targets(self) -> list[int]:
        return self.tokens[self.first_scored:]


def load_tokens(paths: list[str | Path], tokenizer, max_tokens: int | None) -> list[int]:
    """Each file tokenized on its own (no special tokens added), concatenated in order, cut at max_tokens."""
    if not paths:
        raise ValueError("no evaluation text: pass --data FILE (plain UTF-8 text, e.g. a held-out split)")
    ids: list[int] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data file {path} does not exist")
        # verbose=False: the text is longer than the model's context on purpose; windows come later.
        ids += tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False)["input_ids"]
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    ids = ids if max_tokens is None else ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the evaluation text has {len(ids)} tokens; at least 2 are needed")
    return ids


def make_windows(ids: list[int], context_len: int, stride: int) -> list[Window]:
    """Windows of context_len tokens starting every `stride` tokens. With stride == context_len they are disjoint
    and every token but each window's first is scored; with a smaller stride each window scores only the tokens
    the previous one did not (the Hugging Face sliding-window perplexity)."""
    if context_len < 2:
        raise ValueError(f"context length must be at least 2, got {context_len}")
    if not 1 <= stride <= context_len:
        raise ValueError(f"stride must be in [1, context length {context_len}], got {stride}")
    windows, scored_until = [], 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context_len, len(ids))
        first = max(scored_until - begin, 1)
        if end - begin < 2 or first >= end - begin:
            break
        windows.append(Window(begin, ids[begin:end], first))
        scored_until = end
        if end == len(ids):
            break
    return windows
