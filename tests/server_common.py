"""Shared by the server tests: run `quant-serve serve` as a real process on 127.0.0.1 (conftest.shared_server is
the one most of them share)."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO

KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """Poll predicate() until it returns something truthy; return that, or the last value after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.extra_env = env or {}
        self.url = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("quant-serve")
        command = [exe] if exe else [sys.executable, "-m", "quant_serve.server.cli.main"]
        self.command = command + ["serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> "ServerProcess":
        # One intra-op thread: the tiny model gains nothing from more on 2 cores, and oversubscription with the
        # test process (lm-eval, an offline engine) slows both down a lot.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **self.extra_env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        response = httpx.get(self.url + "/health", timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def metrics(self) -> dict[str, float]:
        """Samples by name (the model_name label is checked, then dropped; histogram buckets skipped)."""
        response = httpx.get(self.url + "/metrics", timeout=10)
        assert response.status_code == 200
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for s in family.samples:
                if s.name.startswith("vllm:") and "le" not in s.labels:
                    samples[s.name] = s.value
        return samples

    def pool_is_whole(self) -> bool:
        h = self.health()
        return (h["num_requests_running"] == 0 and h["num_requests_waiting"] == 0 and h["kv_cache_usage"] == 0
                and h["num_free_blocks"] == h["num_blocks"])


@contextlib.contextmanager
def running_server(args: list[str], log_path: Path, env: dict[str, str] | None = None):
    server = ServerProcess(args, log_path, env).start()
    try:
        yield server
    finally:
        server.stop()


def assert_error_shape(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, body
    return error



def post(server, path: str, body: dict, key: str | None = KEY, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def chat_messages(word: str = "lantern") -> list[dict]:
    return [{"role": "user", "content": f'What does "{word}" mean?'}]
