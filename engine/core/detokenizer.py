"""Incremental detokenization with UTF-8 safety and stop strings.

Each step decodes only a small window of tokens (prefix_offset / read_offset, as in vLLM and TGI) and emits the
difference, so the cost per step is O(new tokens). Text is held back while it ends with U+FFFD (a multi-byte
character split across byte-level BPE tokens) and, when stop strings are set, by (longest stop - 1) characters so
that a partial stop string is never emitted.
"""
from quant_serve.engine.sampling_params import SamplingParams

# Prompt tokens decoded as context in front of the first output tokens, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still emit it for the first output token. vLLM uses the same number.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        # A fast tokenizer's Rust backend decodes exactly what `tokenizer.decode(..., clean_up_tokenization_spaces=
        # False)` returns, without the Python wrapper that costs ~5x the decode itself (256 sequences per step).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stop = [s for s in params.stop if s]
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # With include_stop_str_in_output a partial stop string is emitted either way, so nothing is held back.
        hold = bool(self.stop) and not self.include_stop_str_in_output
        self._hold_chars = max(len(s) for s in self.stop) - 1 if hold else 0

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a multi-byte character; output bytes must not complete it, because the
            # output text is defined as the decode of the output tokens alone.
            context = []
        self._ids = context                   # prompt context + output tokens
        self._prefix_offset = 0               # window start: tokens already emitted, decoded again as context
        self._read_offset = len(context)      # tokens before this are in self._text
        self._text = ""                       # decoded output text, truncated at a matched stop string
        self._num_emitted = 0                 # characters of self._text handed out so far
        self.matched_stop: str | None = None

    @property
    def output_text(self) -> str:
        return self._text[:self._num_emitted]

    def _decode(self, ids: list[int]) -> str:
        # no clean-up: it rewrites spaces across token boundaries and would make window decodes disagree
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_window(self, final: bool) -> str:
        """Text of the tokens after read_offset. Unless final, returns "" while that text ends mid-character."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if not final and (len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return text[len(prefix_text):]

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Find the stop string completed first in the last num_new_chars characters; truncate the text there.

        "First" is the smallest end position (then the earliest start), as if text arrived one character at a
        time, so the result does not depend on how tokens are grouped into add_tokens calls.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            # a new match ends in the new text, so it starts at most len(stop) - 1 characters before it
            start = self._text.find(stop, max(0, len(self._text) - num_new_chars - len(stop) + 1))
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        _, start, stop = best
        self._text = self._text[:start + len(stop) if self.include_stop_str_in_output else start]
        self.matched_stop = stop
        return stop

    def _append(self, new_text: str) -> str | None:
        self._text += new_text
        return self._check_stop(len(new_text)) if new_text and self.stop else None

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._num_emitted)
        delta = self._text[self._num_emitted:upto]
        self._num_emitted = upto
        return delta

    def add_tokens(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed newly generated tokens. Returns (text safe to emit now, the stop string matched or None).

        After a stop string matched, further tokens are ignored.
        """
        if self.matched_stop is not None or not token_ids:
            return "", None
        self._ids.extend(token_ids)
        matched = self._append(self._decode_window(final=False))
        if matched is not None:
            return self._emit(len(self._text)), matched
        return self._emit(len(self._text) - self._hold_chars), None

    def finish(self) -> str:
        """Release held-back text at the end of generation (a stop string found in it sets matched_stop)."""
        if self.matched_stop is None:
            self._append(self._decode_window(final=True))
        return self._emit(len(self._text))
