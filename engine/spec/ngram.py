"""Prompt-lookup (n-gram) proposals: no second model. Pure Python + numpy (no torch)."""
import numpy as np


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, trying n from
    n_max down to n_min (a longer match predicts better). [] when nothing matches."""
    num = len(token_ids)
    if k <= 0 or num < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = tokens[num - n:]
        # windows starting at 0 .. num - n - 1: every earlier occurrence, each followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:num - 1], n)        # [num - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n           # the most recent occurrence: copies continue from the latest context
            return token_ids[start:start + k]
    return []
