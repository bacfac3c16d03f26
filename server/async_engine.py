"""Runs LLMEngine.step() in one background thread and routes each step's outputs to per-request asyncio queues.

The engine is not thread-safe, so only the engine thread touches it. Request handlers talk to that thread through
an inbox (add / abort) under a lock, and read a snapshot of its state (queue lengths, KV usage, counters) that the
thread republishes after every change. With no work the thread sleeps on a threading.Event.
"""
import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from quant_serve.engine.llm_engine import LLMEngine
from quant_serve.engine.outputs import RequestOutput
from quant_serve.engine.sampling_params import SamplingParams
from quant_serve.engine.core.sequence import SequenceStatus

logger = logging.getLogger("quant_serve.server")


class QueueFullError(Exception):
    """The waiting queue cannot take the request's sequences (--max-queued-requests counts sequences)."""


class EngineRequestError(Exception):
    """The engine failed while working on this request; the request was aborted, the engine keeps serving."""


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0            # requests with a sequence in the running batch
    num_waiting: int = 0            # requests accepted but not running yet (inbox included)
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    requests_finished_total: int = 0
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()     # accepted tokens by draft position
    structured_forced_tokens_total: int = 0         # generated tokens a grammar forced (jump-forward)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 on_output: Callable[[RequestOutput, float], None] | None = None,
                 on_abort: Callable[[str, int], None] | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests     # waiting sequences (prompts x n), not HTTP requests
        self._on_output = on_output        # metrics hook, called in the engine thread
        self._on_abort = on_abort
        self._lock = threading.RLock()
        self._inbox: list[tuple] = []
        self._num_pending_adds = 0          # requests in the inbox
        self._num_pending_seqs = 0          # their sequences
        self._closing: Callable[[], BaseException] | None = None   # set by fail_all: new requests get its error
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._engine_waiting = 0          # waiting requests inside the engine, as of the last publish
        self._engine_waiting_seqs = 0     # their unfinished sequences that are not running
        self.snapshot = EngineSnapshot()
        with self._lock:
            self._publish()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stopped = False
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- called from request handlers (event loop thread) ------------------------------------------------
    def add_requests(self, prompts: list[tuple[str, list[int], SamplingParams]], n: int = 1,
                     arrival_time: float | None = None) -> "RequestStream":
        """Queue one engine request per (request_id, prompt_token_ids, params), each with n sequences. Raises
        QueueFullError before anything is queued, so the handler can still answer 503. Call from the event loop."""
        if self.started and not self.is_alive:
            raise EngineRequestError("the engine loop is not running; see the server log")
        if self._closing is not None:
            raise self._closing()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        arrival_time = time.time() if arrival_time is None else arrival_time
        num_seqs = len(prompts) * n
        with self._lock:
            queued = self._num_pending_seqs + self._engine_waiting_seqs
            if self.max_queued_requests is not None and queued + num_seqs > self.max_queued_requests:
                raise QueueFullError(f"the server's waiting queue is full ({queued} sequences wait, this request "
                                     f"adds {num_seqs}, the limit is {self.max_queued_requests}); retry later")
            for request_id, token_ids, params in prompts:
                self._streams[request_id] = (loop, queue)
                self._inbox.append(("add", request_id, token_ids, params, n, arrival_time))
            self._num_pending_adds += len(prompts)
            self._num_pending_seqs += num_seqs
        self.start()
        self._wake.set()
        return RequestStream(self, [request_id for request_id, _, _ in prompts], queue)

    async def call(self, fn: Callable[[], object]):
        """fn() on the engine thread between two steps (a LoRA adapter's load: no step reads the slots meanwhile);
        -> its result, or raises its exception. Call from the event loop."""
        if self.started and not self.is_alive:
            raise EngineRequestError("the engine loop is not running; see the server log")
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._inbox.append(("call", None, fn, future.get_loop(), future))
        self.start()
        self._wake.set()
        return await future

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """End every open request with make_error() (a stream answers it with an error event and [DONE]) and refuse
        new ones with it; their engine requests are aborted. For shutdown. Returns how many requests it ended."""
        with self._lock:
            self._closing = make_error
            request_ids = list(self._streams)
            for request_id in request_ids:
                self._fail(request_id, make_error())
                self._inbox.append(("abort", request_id))
        self._wake.set()
        return len(request_ids)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    def close_stream(self, request_id: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    # ---- the engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._wake.wait()
                self._wake.clear()    # after wait, so a wake-up that lands while we work is not lost
                while not self._stopped:
                    self._drain_inbox()
                    if not self.engine.has_unfinished_requests():
                        break
                    self._step()
        except BaseException as e:
            logger.exception("the engine loop died")
            with self._lock:
                for request_id in list(self._streams):
                    self._fail(request_id, EngineRequestError(f"the engine loop died: {e!r}"))
            raise

    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
            for kind, request_id, *args in items:
                if kind == "add":
                    token_ids, params, n, arrival_time = args
                    try:
                        self.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time, n=n)
                    except Exception as e:   # validated by the server already; anything left fails this request
                        self._fail(request_id, e)
                elif kind == "call":
                    _run_call(*args)
                else:
                    self._abort_now(request_id)
            self._num_pending_adds = self._num_pending_seqs = 0
            self._publish()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A failed step cannot be pinned on one request: fail those in flight and keep serving.
            logger.exception("engine step failed; aborting the %d requests in flight", len(self.engine.requests))
            with self._lock:
                for request_id in list(self.engine.requests):
                    self._fail(request_id, EngineRequestError(f"engine step failed: {e!r}"))
                    self._abort_now(request_id)
                self._publish()
            return
        now = time.time()
        with self._lock:
            for output in outputs:
                # Whatever goes wrong with one request's output fails that request only.
                try:
                    if self._on_output is not None:
                        self._on_output(output, now)
                    self._deliver(output.request_id, output)
                except Exception as e:
                    logger.exception("processing the output of request %s failed; aborting it", output.request_id)
                    self._fail(output.request_id, EngineRequestError(f"processing this request's output failed: "
                                                                     f"{e!r}"))
                    self._abort_now(output.request_id)
            self._publish()

    def _abort_now(self, request_id: str) -> None:
        request = self.engine.requests.get(request_id)
        if request is None:         # finished (or never added): nothing to abort, nothing to count
            return
        unfinished = sum(not seq.is_finished for seq in request.seqs)
        self.engine.abort(request_id)
        if self._on_abort is not None:
            self._on_abort(request_id, unfinished)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:      # the handler is gone; its abort is already in the inbox
            return
        loop, queue = stream
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _fail(self, request_id: str, error: BaseException) -> None:
        try:
            self._deliver(request_id, error)
        except RuntimeError:    # the handler's event loop is closed
            pass

    def _publish(self) -> None:
        """Called with the lock held, from the engine thread (and once from __init__)."""
        engine, bm = self.engine, self.engine.block_manager
        running = waiting = waiting_seqs = 0
        for request in engine.requests.values():
            if any(seq.status == SequenceStatus.RUNNING for seq in request.seqs):
                running += 1
            elif not all(seq.is_finished for seq in request.seqs):
                waiting += 1
            waiting_seqs += sum(seq.status != SequenceStatus.RUNNING and not seq.is_finished for seq in request.seqs)
        self._engine_waiting, self._engine_waiting_seqs = waiting, waiting_seqs
        stats = engine.stats
        self.snapshot = EngineSnapshot(
            num_running=running, num_waiting=waiting + self._num_pending_adds, kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            prompt_tokens_total=stats.prompt_tokens_total, generation_tokens_total=stats.generation_tokens_total,
            num_preemptions_total=engine.scheduler.num_preemptions_total,
            prefix_cache_queries_total=bm.prefix_queries, prefix_cache_hits_total=bm.prefix_hits,
            requests_finished_total=stats.requests_finished_total,
            spec_num_drafts_total=engine.spec_stats.num_drafts,
            spec_num_draft_tokens_total=engine.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens_total=engine.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(engine.spec_stats.accepted_per_pos),
            structured_forced_tokens_total=stats.structured_forced_tokens_total)


class RequestStream:
    """Async iterator over the outputs of the requests queued by one add_requests call, interleaved as they come,
    until all have finished. close() (idempotent; also on exhaustion) aborts the unfinished ones: use it in a
    finally block, so a client that goes away frees its KV blocks."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue):
        self._engine = engine
        self.request_ids = request_ids
        self._queue = queue
        self._unfinished = set(request_ids)
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            self.close()
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def __del__(self):
        self.close()    # a streaming response that never started still aborts its requests

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id in self.request_ids:
            self._engine.close_stream(request_id, finished=request_id not in self._unfinished)


def _run_call(fn, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
    """AsyncEngine.call's fn, on the engine thread; its result or exception settles the caller's future."""
    try:
        result, error = fn(), None
    except Exception as e:
        result, error = None, e
    loop.call_soon_threadsafe(lambda: future.done() or (future.set_exception(error) if error else
                                                         future.set_result(result)))
