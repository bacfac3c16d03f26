"""Forced tokens (jump-forward, issue 54): where a constrained sequence's grammar allows one token after another
(the keys, quotes and separators of a JSON schema), those tokens need no forward each. The mask worker finds them
(forced_chains); the engine appends them behind the token the sequence samples (LLMEngine.accept_tokens), and the
next forward computes their KV as one prefill chunk.
"""
import numpy as np

# A forced chain is taken when it holds at least this many tokens: its first is sampled as usual and its KV computed
# by the next step, which the engine has already launched (its token for the row is dropped); the rest go in one
# prefill chunk the step after. Two tokens save nothing.
MIN_FORCED_CHAIN = 3


def single_token(words: np.ndarray) -> int | None:
    """The one token a mask row (uint32 words) allows, or None."""
    nonzero = np.flatnonzero(words)
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]])
    return None if word & (word - 1) else int(nonzero[0]) * 32 + word.bit_length() - 1


def forced_chains(executor, rows: list, words: np.ndarray, eos_ids: list[int], limit: int
                  ) -> dict[int, list[int]]:
    """Rows whose mask allows one token (not an EOS): that token and those the grammar allows alone after it,
    up to `limit`, each checked by its own mask, so that the chain is exactly what step-by-step decoding would
    sample. The matchers consume their chain (rounds over all such rows at once, in llguidance's thread pool); a
    chain shorter than MIN_FORCED_CHAIN is rolled back."""
    from llguidance.numpy import fill_next_token_bitmask_par
    active = [(r, t) for r in rows if r.matcher is not None and not r.matcher.is_error()
              and not r.matcher.is_stopped() and (t := single_token(words[r.index])) is not None
              and t not in eos_ids]
    chains = {r.index: [] for r, _ in active}
    while active:
        if hasattr(executor, "consume_token_par"):
            executor.consume_token_par([(r.matcher, t) for r, t in active])
        else:
            for r, t in active:
                r.matcher.consume_token(t)
        for r, t in active:
            chains[r.index].append(t)
        active = [(r, t) for r, t in active if len(chains[r.index]) < limit and not r.matcher.is_error()
                  and not r.matcher.is_stopped()]
        if not active:
            break
        scratch = np.empty((len(active), words.shape[1]), dtype=np.int32)
        fill_next_token_bitmask_par(executor, [(r.matcher, j) for j, (r, _) in enumerate(active)], scratch)
        active = [(r, t) for j, (r, _) in enumerate(active)
                  if (t := single_token(scratch[j].view(np.uint32))) is not None and t not in eos_ids]
    by_row = {r.index: r for r in rows}
    for index, chain in list(chains.items()):
        if len(chain) < MIN_FORCED_CHAIN:
            by_row[index].matcher.rollback(len(chain))
            del chains[index]
    return chains
