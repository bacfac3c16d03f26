"""Client-supplied chat templates (--allow-client-chat-template) render in worker processes, never in the server's.

Jinja's sandbox (transformers renders every template in an ImmutableSandboxedEnvironment) keeps a template from
reaching Python internals, but not from looping for hours or building a gigabyte string. A thread cannot be stopped,
so each render runs in a spawned worker that holds its own tokenizer: a render that passes the time limit gets its
worker killed (the next one is started), the worker's address space is capped (MemoryError instead of the server's
memory), and the rendered text is refused above a size limit before it is tokenized.
"""
import logging
import multiprocessing
import os
import queue
import threading
from dataclasses import dataclass

logger = logging.getLogger("quant_serve.server")

WORKER_START_TIMEOUT_S = 120.0          # importing transformers and loading the tokenizer
WORKER_MEMORY_HEADROOM = 1 << 30        # address space a render may add to the worker's own


class TemplateRejected(Exception):
    """The client's template failed, ran too long, or used too much memory; the message says which."""


class TemplateTimeout(TemplateRejected):
    pass


@dataclass
class ChatJob:
    messages: list[dict]
    template: str
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict
    sanitize: bool                     # control tokens in the client's strings are encoded as text


def render_and_encode(tokenizer, job: ChatJob, max_chars: int) -> list[int]:
    """Render job's template over its messages and tokenize the text (in the worker)."""
    kwargs = dict(chat_template=job.template, add_generation_prompt=job.add_generation_prompt,
                  continue_final_message=job.continue_final_message, **job.template_kwargs)
    text = tokenizer.apply_chat_template(job.messages, tokenize=False, **kwargs)
    if not isinstance(text, str):
        raise TemplateRejected("the chat template must render text")
    if len(text) > max_chars:
        raise TemplateRejected(f"the chat template rendered {len(text)} characters, more than the limit of "
                               f"{max_chars}")
    if job.sanitize:
        return list(tokenizer.apply_chat_template(job.messages, tokenize=True, return_dict=False,
                                                  sanitize_control_tokens=True, **kwargs))
    return tokenizer.encode(text, add_special_tokens=False)


def _worker_main(conn, tokenizer_path: str, max_chars: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    try:
        import resource
        with open("/proc/self/statm") as f:
            in_use = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = in_use + WORKER_MEMORY_HEADROOM
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    except (ImportError, OSError, ValueError):      # no RLIMIT_AS here (macOS, Windows): the time limit still holds
        pass
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:                 # the server went away
            return
        try:
            conn.send(("ok", render_and_encode(tokenizer, job, max_chars)))
        except MemoryError:
            conn.send(("error", f"the chat template needed more than {WORKER_MEMORY_HEADROOM >> 20} MiB"))
        except TemplateRejected as e:
            conn.send(("error", str(e)))
        except Exception as e:          # jinja errors, raise_exception() in the template
            conn.send(("error", f"cannot apply the chat template: {type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self, tokenizer_path: str, max_chars: int):
        context = multiprocessing.get_context("spawn")      # fork is unsafe beside CUDA and threads
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, tokenizer_path, max_chars), daemon=True,
                                       name="chat-template-sandbox")
        self.process.start()
        child.close()
        self.ready = False

    def run(self, job: ChatJob, timeout_s: float) -> list[int]:
        if not self.ready:
            if not self.conn.poll(WORKER_START_TIMEOUT_S):
                raise RuntimeError("the chat template sandbox did not start")
            self.conn.recv()
            self.ready = True
        self.conn.send(job)
        if not self.conn.poll(timeout_s):
            raise TemplateTimeout(f"the chat template took longer than {timeout_s:g} s to render")
        status, value = self.conn.recv()
        if status == "error":
            raise TemplateRejected(value)
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class TemplateSandbox:
    """Up to max_workers renders at a time, each in its own worker process; idle workers are kept for the next."""

    def __init__(self, tokenizer_path: str, timeout_s: float, max_chars: int, max_workers: int = 2):
        self.tokenizer_path, self.timeout_s, self.max_chars = tokenizer_path, timeout_s, max_chars
        self._slots = threading.BoundedSemaphore(max_workers)
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()

    def start(self) -> None:
        """Start one worker now, so the first client template does not wait for it."""
        self._idle.put(_Worker(self.tokenizer_path, self.max_chars))

    def encode(self, job: ChatJob) -> list[int]:
        """Blocking (call it from a thread pool). Raises TemplateRejected with a message for the client."""
        with self._slots:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                worker = _Worker(self.tokenizer_path, self.max_chars)
            try:
                ids = worker.run(job, self.timeout_s)
            except TemplateTimeout:
                worker.kill()                       # it may still be looping: never reuse it
                raise
            except TemplateRejected:
                self._idle.put(worker)
                raise
            except (OSError, EOFError, RuntimeError) as e:     # the worker died (killed by the OS, crashed)
                worker.kill()
                logger.warning("a chat template sandbox worker failed: %r", e)
                raise TemplateRejected("the chat template crashed its sandbox") from e
            self._idle.put(worker)
            return ids

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return
