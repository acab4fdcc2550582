"""Replicas of our server behind SGLang's router (the ``sglang-router`` package, Rust binary).

``start_replicas`` starts several servers with the same flags side by side; ``RouterProcess``
runs ``python -m sglang_router.launch_router`` in front of them on a free loopback port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from sgl_jax.srt.utils import free_port
from sgl_jax.testing import ServerProcess, wait_until
from tests.server_utils import start_server


def start_replicas(args: list[str], count: int) -> list[ServerProcess]:
    """``count`` servers with the same flags, loading and compiling at the same time."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(start_server, args) for _ in range(count)]
    started, errors = [], []
    for future in futures:
        try:
            started.append(future.result())
        except Exception as e:  # collect every failure, then stop what did start
            errors.append(e)
    if errors:
        for server in started:
            server.stop()
        raise errors[0]
    return started


def show_logs_if_failed(request: pytest.FixtureRequest, failed_before: int,
                        processes: list[Any]) -> None:
    """Writes the logs of ``processes`` (anything with ``log_path`` and ``log()``) to the
    terminal when a test of the fixture's scope failed."""
    if request.session.testsfailed == failed_before:
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for proc in processes:
        text = f"\n----- log of {proc.log_path} -----\n{proc.log()[-20000:]}"
        if reporter is not None:
            reporter.write_line(text)
        else:
            print(text)


def replicas_fixture(request: pytest.FixtureRequest, args: list[str],
                     count: int) -> Iterator[list[ServerProcess]]:
    """Body of a module-scoped fixture: ``count`` replicas, their logs shown on failure."""
    failed_before = request.session.testsfailed
    replicas = start_replicas(args, count)
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()
        show_logs_if_failed(request, failed_before, replicas)


class RouterProcess:
    """sglang-router on ``127.0.0.1:<free port>`` (``url``) in front of ``workers``, with
    every worker healthy when constructed. Its process title is ``sglang::router``: it is
    stopped through this object's handle, never by name."""

    def __init__(self, workers: list[str], policy: str, extra: list[str] | None = None,
                 startup_timeout: float = 60.0) -> None:
        self.policy = policy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix=f"sglang_router_{policy}_", suffix=".log")
        self._log = os.fdopen(fd, "w")
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
               "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port()), "--log-level", "warn",
               # workers are up already: no reason to wait the default 30 s between checks
               "--worker-startup-check-interval", "1", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NO_COLOR": "1"})
        try:
            if not wait_until(lambda: self.healthy_workers() == len(workers),
                              timeout=startup_timeout, interval=0.1):
                raise RuntimeError(f"the router did not see {len(workers)} healthy workers in "
                                   f"{startup_timeout}s; log:\n{self.log()[-5000:]}")
        except BaseException:
            self.stop()
            raise

    def workers(self) -> list[dict[str, Any]]:
        return requests.get(self.url + "/workers", timeout=5).json()["workers"]

    def healthy_workers(self) -> int:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {self.proc.returncode}; log:\n"
                               f"{self.log()[-5000:]}")
        try:
            return sum(w["is_healthy"] for w in self.workers())
        except (requests.RequestException, ValueError, KeyError):
            return -1

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.post(self.url + path, **kw)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    if not wait_until(predicate, timeout=timeout, interval=0.05):
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
