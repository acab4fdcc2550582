"""Start a real ``python -m sgl_jax.launch_server`` subprocess on a free port, wait, stop it.

The server's log goes to a temp file; a server that fails to start raises with the log's tail,
and ``server_fixture`` writes the whole log to the terminal when a test of its module failed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import requests

# Small buckets keep start-up short; the persistent compilation cache makes restarts cheap.
FAST_ARGS = [
    "--precompile-bs-paddings", "1", "4",
    "--precompile-token-paddings", "64", "256",
    "--chunked-prefill-size", "256",
    "--max-running-requests", "4",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        fd, self.log_path = tempfile.mkstemp(prefix="sgl_jax_server_", suffix=".log")
        self._log = os.fdopen(fd, "w")
        cmd = [sys.executable, "-m", "sgl_jax.launch_server", "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} at "
                                   f"start-up; log:\n{self.log()[-5000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not healthy within {timeout}s; log:\n"
                           f"{self.log()[-5000:]}")

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers, timeout=60, **kw)

    def post(self, path: str, **kw) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                             **kw)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Sends ``sig`` and returns the exit code (kills after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def server_fixture(request: pytest.FixtureRequest, args: list[str],
                   api_key: str | None = None) -> Iterator[ServerProcess]:
    """Body of a module-scoped fixture: one server for the module, its log shown on failure."""
    failed_before = request.session.testsfailed
    server = ServerProcess(args, api_key=api_key)
    try:
        yield server
    finally:
        server.stop()
        if request.session.testsfailed > failed_before:
            reporter = request.config.pluginmanager.get_plugin("terminalreporter")
            text = f"\n----- server log ({server.log_path}) -----\n{server.log()}"
            if reporter is not None:
                reporter.write_line(text)
            else:
                print(text)


def sse_events(source: requests.Response | Iterator[str]) -> list[dict | str]:
    """The ``data:`` payloads of an event stream: JSON objects, and "[DONE]" as a string.

    Pass the same ``iter_lines(decode_unicode=True)`` iterator when part of the stream was
    already read: a second ``iter_lines`` would lose what the first one had buffered.
    """
    lines = source.iter_lines(decode_unicode=True) if isinstance(source, requests.Response) \
        else source
    events: list[dict | str] = []
    for line in lines:
        if line and line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
