"""Token ids of a long text with the memory of a short one. A fast tokenizer's encode keeps, for every token, its
string, offsets, word index and masks beside the id, and the normalized text with an alignment per byte: ~330 bytes
a token, so a 1.9 MB /tokenize body (1.8M tokens) took +598 MiB of RSS. Encoded in pieces of PIECE_CHARS, only one
piece's encoding is alive at a time and the ids are all that is kept: +56 MiB.

The ids must be those of encoding the text whole. A piece ends only where the usual pre-tokenizers (the GPT-2,
Llama 3 and Qwen2 split patterns, Metaspace) always start a new word: before a space that follows a non-space, or
where an ASCII letter or digit run meets an ASCII character of another kind (not before letters: "!abc" is one
word). Each cut is also checked where it is made: CHECK_CHARS either side of it encoded whole must give the ids of
the two sides encoded apart (this catches added tokens, normalizers and prefix spaces of other tokenizers). A cut
that fails is not made; a text with no good cut is encoded whole, as before."""
PIECE_CHARS = 1 << 14         # text per encode call
CHECK_CHARS = 256             # either side of a cut, encoded whole and apart
SEARCH_CHARS = 1 << 12        # how far past a piece's target end a cut is looked for
TRIES = 8                     # cuts checked per piece before the piece grows to the next target


def encode_long(tokenizer, text: str, add_special_tokens: bool = True, piece_chars: int = PIECE_CHARS) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...), in pieces of about piece_chars where the text is long."""
    if len(text) <= 2 * piece_chars:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    cuts = _cuts(tokenizer, text, piece_chars)
    if not cuts:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ids: list[int] = []
    bounds = [0, *cuts, len(text)]
    for start, end in zip(bounds, bounds[1:]):
        ids += tokenizer.encode(text[start:end], add_special_tokens=False)
    if not add_special_tokens:
        return ids
    first = text[:cuts[0]]          # what the tokenizer puts around a text (a BOS, an EOS), from the first piece
    around = _around(tokenizer.encode(first, add_special_tokens=True),
                     tokenizer.encode(first, add_special_tokens=False))
    if around is None:
        return tokenizer.encode(text, add_special_tokens=True)
    return around[0] + ids + around[1]


def _around(with_specials: list[int], plain: list[int]) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) `plain` inside `with_specials`; None when it is not inside."""
    for i in range(len(with_specials) - len(plain) + 1):
        if with_specials[i:i + len(plain)] == plain:
            return with_specials[:i], with_specials[i + len(plain):]
    return None


def _cuts(tokenizer, text: str, piece_chars: int) -> list[int]:
    cuts, target = [], piece_chars
    while target < len(text) - piece_chars:
        cut = _find_cut(tokenizer, text, target)
        if cut is not None:
            cuts.append(cut)
            target = cut + piece_chars
        else:
            target += piece_chars
    return cuts


def _find_cut(tokenizer, text: str, target: int) -> int | None:
    tries = 0
    for j in range(target, min(target + SEARCH_CHARS, len(text) - 1)):
        if not _word_start(text[j - 1], text[j]):
            continue
        if _clean(tokenizer, text, j):
            return j
        tries += 1
        if tries == TRIES:
            return None
    return None


def _word_start(before: str, after: str) -> bool:
    if after == " ":
        return not before.isspace()
    if not (before.isascii() and after.isascii()) or after.isspace() or after.isalpha():
        return False
    if before.isalpha():
        return True                 # letters, then a digit or punctuation
    return before.isdigit() and not after.isdigit()


def _clean(tokenizer, text: str, j: int) -> bool:
    """Cutting at j changes no id of the CHECK_CHARS either side of it."""
    a, b = max(0, j - CHECK_CHARS), min(len(text), j + CHECK_CHARS)
    whole = tokenizer.encode(text[a:b], add_special_tokens=False)
    return whole == tokenizer.encode(text[a:j], add_special_tokens=False) + \
        tokenizer.encode(text[j:b], add_special_tokens=False)
