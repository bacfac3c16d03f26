"""Token masks of constrained sequences, one step at a time.

Each constrained sequence has a matcher (llguidance) that catches up with the sequence's accepted tokens when its
next mask is needed; the masks of a step's rows are filled on the host in one call (llguidance's thread pool, the
GIL released), in a worker thread begun as soon as those tokens are applied (GrammarMasks.start), so they are
computed while the device runs the step's forward and the host schedules the next; the sampler copies the one
packed bitmask to the device and applies it to the logits in place (apply_bitmask: plain torch and numpy, CPU and
CUDA alike). A row's mask needs its previous token on the host: the engine samples a step with a constrained row
behind the next step's preparation (sampler.needs_last_token_on_host, LLMEngine._sample_behind).
"""
import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from quant_serve.engine.core.sequence import Sequence
from quant_serve.engine.sample.structured import GrammarCompiler
from quant_serve.engine.sample.structured_forced import forced_chains
from quant_serve.engine.sample.structured_limits import short
from quant_serve.engine.worker.transfer import to_device

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
    num_consumed: int = 0           # output tokens handed to the matcher

    def new_tokens(self, seq: Sequence, eos: int) -> list[int]:
        """The tokens accepted since its last mask, now counted as consumed; every EOS id of the model is its EOS."""
        assert seq.num_pending_tokens == 0, "a constrained row was scheduled ahead of its last token"
        new = seq.token_ids[seq.num_prompt_tokens + self.num_consumed:]
        self.num_consumed += len(new)
        return [eos if token in seq.eos_token_ids else token for token in new]


@dataclass
class _Row:
    index: int                      # in the step's sampling rows
    matcher: object | None          # None: its grammar failed before (only EOS)
    tokens: list[int]               # to consume before its mask


@dataclass
class MaskResult:
    mask: np.ndarray                # int32 [S, words]
    complete: list[int]             # rows whose grammar is complete or failed: only EOS is allowed
    errors: dict[int, str]          # row -> the library's error, for grammars that failed here
    forced: dict[int, list[int]] = field(default_factory=dict)   # row -> its forced chain (see forced_chains)


def _eos_only(words: np.ndarray, row: int, eos: int) -> None:
    words[row] = 0
    words[row, eos // 32] = np.uint32(1 << (eos % 32))


def compute_masks(executor, rows: list[_Row], num_rows: int, vocab_size: int, eos_ids: list[int],
                  max_forced: int = 0, force: list[_Row] | None = None) -> MaskResult:
    """The rows' matchers catch up with their new tokens, then every mask is filled in one call (llguidance's
    thread pool, the GIL released), then the forced chains of the `force` rows (max_forced tokens at most; see
    forced_chains). Touches only these matchers and its own mask: it runs in a worker thread while the engine goes
    on (GrammarMasks.start) or inline (GrammarMasks.fill)."""
    from llguidance.numpy import fill_next_token_bitmask_par
    mask = np.full((num_rows, bitmask_words(vocab_size)), -1, dtype=np.int32)
    words = mask.view(np.uint32)
    eos, *other_eos = eos_ids
    live = [r for r in rows if r.matcher is not None]
    # one token each (a decode step): in one parallel call; a complete grammar takes no more (ignore_eos,
    # min_tokens: what follows it is EOS)
    singles = [(r.matcher, r.tokens[0]) for r in live if len(r.tokens) == 1 and not r.matcher.is_stopped()]
    if singles and hasattr(executor, "consume_token_par"):      # llguidance >= 1.8
        executor.consume_token_par(singles)
    elif singles:
        for matcher, token in singles:
            matcher.consume_token(token)
    for r in live:
        for token in r.tokens if len(r.tokens) > 1 else ():
            if r.matcher.is_stopped():
                break
            r.matcher.consume_token(token)
    ready = [(r.matcher, r.index) for r in live if not r.matcher.is_error()]
    if ready:
        fill_next_token_bitmask_par(executor, ready, mask)
    complete, errors = [], {}
    for r in rows:
        if r.matcher is None or r.matcher.is_error():      # a token it did not allow, a parser limit: EOS only
            if r.matcher is not None:
                errors[r.index] = r.matcher.get_error()
            _eos_only(words, r.index, eos)
            complete.append(r.index)
        elif r.matcher.is_stopped():
            complete.append(r.index)
    if other_eos:                           # where the grammar allows its EOS, every EOS id of the model
        ends = ((words[:, eos // 32] >> np.uint32(eos % 32)) & 1).astype(bool)
        for t in other_eos:
            words[ends, t // 32] |= np.uint32(1 << (t % 32))
    forced = forced_chains(executor, force, words, eos_ids, max_forced) if max_forced and force else {}
    return MaskResult(mask, complete, errors, forced)


class GrammarMasks:
    """The matchers of the running constrained sequences (keyed by sequence id) and the masks of a step.

    With async scheduling the engine calls start() as soon as the tokens a step's rows follow are applied: the
    masks are computed in a worker thread while that step's forward runs and the host schedules and prepares the
    next step; the sampler's fill() then only waits for what is left of them. Without start(), fill() computes them
    inline.

    A grammar that fails during generation (a parser limit met past the tokens the compile-time probe followed, a
    token its mask did not allow) never yields a token that breaks it: its row allows only EOS for the step, and
    the sequence is listed in `failures` (sequence id -> the library's error, short) for the engine, which ends it
    with finish_reason "error" and drops that row's token (LLMEngine.accept_tokens)."""

    def __init__(self, compiler: GrammarCompiler, max_forced: int = 0):
        self.compiler = compiler
        self.max_forced = max_forced          # forced tokens per chain (jump-forward); 0: off
        self._states: dict[str, _SequenceGrammar] = {}
        self._executor = None                 # llguidance.LLExecutor
        self._pool: ThreadPoolExecutor | None = None
        self._job: tuple[list[Sequence], int, Future] | None = None     # (rows, vocab size, MaskResult)
        self.failures: dict[str, str] = {}
        self.forced: dict[str, list[int]] = {}       # sequence id -> its forced chain, for the engine

    def release(self, seq_id: str) -> None:
        self._states.pop(seq_id, None)       # a job in flight keeps its matcher object until it ends

    def take_failures(self) -> dict[str, str]:
        failures, self.failures = self.failures, {}
        return failures

    def take_forced(self) -> dict[str, list[int]]:
        """Sequence id -> the chain its last mask forced: the first token is the one it sampled, the others follow
        it without being sampled (the matcher has consumed them all)."""
        forced, self.forced = self.forced, {}
        return forced

    def unforce(self, seq_id: str, num_tokens: int) -> None:
        """A chain that did not make it into the sequence (it sampled another token or ended): the matcher goes
        back before it."""
        state = self._states.get(seq_id)
        if state is not None:
            state.matcher.rollback(num_tokens)
            state.num_consumed -= num_tokens

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

    def _rows(self, seqs: list[Sequence], skip: frozenset[int] = frozenset()) -> list[_Row]:
        """What each constrained row's mask needs, taken on the engine's thread. A sequence that ended since its
        step was scheduled (a stop string found meanwhile) samples a token nobody reads: no matcher for it, which
        would outlive its release; nor for the rows in skip (ids of sequences whose token the engine drops)."""
        eos = self.compiler.eos_token_ids[0]
        rows = []
        for i, seq in enumerate(seqs):
            if seq.params.structured_outputs is None or seq.is_finished or id(seq) in skip:
                continue
            state = self._state(seq)
            rows.append(_Row(i, None, []) if state is None else _Row(i, state.matcher, state.new_tokens(seq, eos)))
        return rows

    def _llg_executor(self):
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _force(self, rows: list[_Row], seqs: list[Sequence]) -> list[_Row]:
        """The rows that may take a forced chain: not those that want logprobs (a forced token has none)."""
        return [r for r in rows if seqs[r.index].params.logprobs is None] if self.max_forced else []

    def start(self, seqs: list[Sequence], vocab_size: int, skip: frozenset[int] = frozenset()) -> None:
        """Begins the masks of a step's sampling rows (seqs, in row order) in a worker thread; skip: see _rows."""
        self._finish_job()
        rows = self._rows(seqs, skip)
        if not rows:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        future = self._pool.submit(compute_masks, self._llg_executor(), rows, len(seqs), vocab_size,
                                   self.compiler.eos_token_ids, self.max_forced, self._force(rows, seqs))
        self._job = (seqs, vocab_size, future)

    def _finish_job(self) -> MaskResult | None:
        job, self._job = self._job, None
        return None if job is None else self.wait(job[2])

    def wait(self, future: Future) -> MaskResult:
        """The masks begun by start() (the engine waits here only for what the forward did not hide)."""
        return future.result()

    def fill(self, seqs: list[Sequence], vocab_size: int) -> tuple[np.ndarray, list[int]]:
        """The host bitmask int32 [S, words] of a step's rows (a row without a constraint allows every token) and
        the rows whose grammar is complete or failed (only EOS is allowed)."""
        job = self._job
        begun = job is not None and job[1] == vocab_size and len(job[0]) == len(seqs) and \
            all(a is b for a, b in zip(job[0], seqs))
        result = self._finish_job()
        if not begun:           # a job for other rows had its matchers catch up: these rows go on from there
            rows = self._rows(seqs)
            result = compute_masks(self._llg_executor(), rows, len(seqs), vocab_size, self.compiler.eos_token_ids,
                                   self.max_forced, self._force(rows, seqs))
        for i, error in result.errors.items():
            self._fail(seqs[i], error)
        for i, chain in result.forced.items():      # consumed by the matcher: counted now
            state = self._states.get(seqs[i].request_id)
            if state is not None:                   # not aborted meanwhile
                state.num_consumed += len(chain)
                self.forced[seqs[i].request_id] = chain
        return result.mask, result.complete

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> frozenset[int]:
        """Masks the rows of constrained sequences in place (one host bitmask, one copy, one masked fill); returns
        the rows whose grammar is complete."""
        mask, complete = self.fill(seqs, logits.shape[1])
        apply_bitmask(logits, mask)
        return frozenset(complete)
