"""Token masks of constrained sequences, one step at a time.

Each constrained sequence has a matcher (llguidance) that catches up with the sequence's accepted tokens when its
next mask is needed; the masks of a step's rows are filled on the host in one call (llguidance's thread pool, the
GIL released) after the forward was queued, so they are computed while the device runs it; the sampler copies the
one packed bitmask to the device and applies it to the logits in place (apply_bitmask: plain torch and numpy, CPU and
CUDA alike).
A row's mask needs its previous token on the host: the engine never launches a step ahead of the tokens of a
constrained row (sampler.needs_last_token_on_host), which makes that row's steps synchronous.
"""
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from quant_serve.engine.sequence import Sequence
from quant_serve.engine.structured import GrammarCompiler
from quant_serve.engine.structured_limits import short
from quant_serve.engine.transfer import to_device

logger = logging.getLogger("quant_serve")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [S, ceil(V / 32)], bit t % 32 of word t // 32 set when token t is allowed (llguidance's
    layout) -> bool [S, V] on the bitmask's device. Byte b of the little-endian words holds tokens 8b .. 8b + 7."""
    rows = bitmask.shape[0]
    as_bytes = bitmask.view(torch.uint8)                                                   # [S, 4 * words]
    bits = (as_bytes[:, :, None] >> torch.arange(8, dtype=torch.uint8, device=bitmask.device)) & 1
    return bits.view(rows, -1)[:, :vocab_size] != 0


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Sets the logits [S, V] of the tokens the host bitmask int32 [S, ceil(V / 32)] does not allow to -inf, in
    place; an all-ones row leaves its logits as they are. On a GPU the packed mask is copied (queued, no wait) and
    unpacked there; on the CPU numpy unpacks it (a third of the time of the torch unpacking there)."""
    rows, vocab = logits.shape
    assert bitmask.shape == (rows, bitmask_words(vocab)) and bitmask.dtype == np.int32, \
        (bitmask.shape, bitmask.dtype, tuple(logits.shape))
    if logits.device.type == "cpu":
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        logits.masked_fill_(torch.from_numpy(allowed.view(np.bool_)).logical_not(), float("-inf"))
    else:
        banned = allowed_tokens(to_device(bitmask, torch.int32, logits.device), vocab).logical_not_()
        logits.masked_fill_(banned, float("-inf"))


assert sys.byteorder == "little", "apply_bitmask reads the int32 mask words as little-endian bytes"


@dataclass
class _SequenceGrammar:
    matcher: object                 # llguidance.LLMatcher
    num_consumed: int = 0           # output tokens fed to the matcher

    def catch_up(self, seq: Sequence, eos: int) -> None:
        """Feeds the matcher the tokens accepted since its last mask; every EOS id of the model is its one EOS."""
        assert seq.num_pending_tokens == 0, "a constrained row was scheduled ahead of its last token"
        new = seq.token_ids[seq.num_prompt_tokens + self.num_consumed:]
        for token in new:
            if self.matcher.is_stopped():      # complete: what follows is EOS (ignore_eos, min_tokens)
                break
            self.matcher.consume_token(eos if token in seq.eos_token_ids else token)
        self.num_consumed += len(new)


class GrammarMasks:
    """The matchers of the running constrained sequences (keyed by sequence id) and the masks of a step.

    A grammar that fails during generation (a parser limit met past the tokens the compile-time probe followed, a
    token its mask did not allow) never yields a token that breaks it: its row allows only EOS for the step, and
    the sequence is listed in `failures` (sequence id -> the library's error, short) for the engine, which ends it
    with finish_reason "error" and drops that row's token (LLMEngine.accept_tokens)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._states: dict[str, _SequenceGrammar] = {}
        self._executor = None
        self.failures: dict[str, str] = {}

    def release(self, seq_id: str) -> None:
        self._states.pop(seq_id, None)

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def _fail(self, seq: Sequence, error: str) -> None:
        if seq.request_id not in self.failures:
            self.failures[seq.request_id] = error = short(error)
            logger.warning("sequence %s: its grammar failed during generation (%s); it ends with an error",
                           seq.request_id, error)

    def _state(self, seq: Sequence) -> _SequenceGrammar | None:
        state = self._states.get(seq.request_id)
        if state is None:
            try:            # the compiled grammar left the cache since the request was accepted: compiled again
                matcher = self.compiler.matcher(seq.params.structured_outputs)
            except ValueError as e:
                self._fail(seq, str(e))
                return None
            state = self._states[seq.request_id] = _SequenceGrammar(matcher)
        return state

    def fill(self, seqs: list[Sequence], vocab_size: int) -> tuple[np.ndarray, list[int]]:
        """The host bitmask int32 [S, words] of a step's rows (a row without a constraint allows every token) and
        the rows whose grammar is complete or failed (only EOS is allowed)."""
        mask = np.full((len(seqs), bitmask_words(vocab_size)), -1, dtype=np.int32)
        words = mask.view(np.uint32)
        eos, *other_eos = self.compiler.eos_token_ids
        rows, complete = [], []
        for i, seq in enumerate(seqs):
            # a sequence that ended since this step was scheduled (its stop string was found meanwhile) samples a
            # token nobody reads: no matcher for it, which would outlive its release
            if seq.params.structured_outputs is None or seq.is_finished:
                continue
            state = self._state(seq)
            if state is not None:
                state.catch_up(seq, eos)
            if state is None or state.matcher.is_error():   # a token the mask did not allow
                if state is not None:
                    self._fail(seq, state.matcher.get_error())
                words[i] = 0
                words[i, eos // 32] = np.uint32(1 << (eos % 32))
                complete.append(i)
                continue
            rows.append((state.matcher, i))
            if state.matcher.is_stopped():
                complete.append(i)
        if rows:
            if self._executor is None:
                import llguidance
                self._executor = llguidance.LLExecutor()
            from llguidance.numpy import fill_next_token_bitmask_par
            fill_next_token_bitmask_par(self._executor, rows, mask)
            for matcher, i in rows:        # a parser limit met while computing the mask
                if matcher.is_error():
                    self._fail(seqs[i], matcher.get_error())
                    words[i] = 0
                    words[i, eos // 32] = np.uint32(1 << (eos % 32))
                    complete.append(i)
        if other_eos:                           # where the grammar allows its EOS, every EOS id of the model
            ends = ((words[:, eos // 32] >> np.uint32(eos % 32)) & 1).astype(bool)
            for t in other_eos:
                words[ends, t // 32] |= np.uint32(1 << (t % 32))
        return mask, complete

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> frozenset[int]:
        """Masks the rows of constrained sequences in place (one host bitmask, one copy, one masked fill); returns
        the rows whose grammar is complete."""
        mask, complete = self.fill(seqs, logits.shape[1])
        apply_bitmask(logits, mask)
        return frozenset(complete)
