"""How long /health takes while the server is attacked (M16; docs/reliability.md).

Starts a real server (the fast test settings, default HTTP flags), then runs each attack while
a thread asks /health every 50 ms and samples the server process's memory and open files:

- ``baseline``: nothing.
- ``big_prompt``: a 31.5 MB prompt on /generate (under the 32 MiB body limit).
- ``many_sequences``: /v1/completions with 1,000 prompts x n=128 (a 10 KB body).
- ``slow_headers``: 2,000 connections that send half a request's headers, held 15 s (past
  the header deadline).
- ``connection_flood``: 10,000 such connections opened as fast as possible (beyond
  --http-max-connections).

Prints one markdown row per attack: the attack's HTTP status and seconds, /health latency
(median, p99, max) and failures, the server's peak RSS and open files. With
``bench_ab_commits.py --base REV`` the same attacks run against an older tree (it must accept
the flags used here: the defaults only). Every attack is bounded in time and count and sends
traffic to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_utils import machine_description, markdown_table  # noqa: E402

from sgl_jax.testing import ServerProcess, server_flags  # noqa: E402

ATTACK_TIMEOUT = 120.0


class Probe:
    """/health every 50 ms, and the server's RSS and open files, while an attack runs."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.proc = url + "/health", psutil.Process(pid)
        self.latencies: list[float] = []
        self.failures = 0
        self.peak_rss = self.peak_fds = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._health, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]

    def _health(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                ok = requests.get(self.url, timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            self.latencies.append(time.perf_counter() - start)
            self.failures += not ok
            self._stop.wait(0.05)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_rss = max(self.peak_rss, self.proc.memory_info().rss)
                self.peak_fds = max(self.peak_fds, self.proc.num_fds())
            except psutil.Error:
                return
            self._stop.wait(0.05)

    def __enter__(self) -> Probe:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(ATTACK_TIMEOUT)


def _post(url: str, body: dict[str, Any]) -> str:
    try:
        return str(requests.post(url, json=body, timeout=ATTACK_TIMEOUT).status_code)
    except requests.RequestException as e:
        return type(e).__name__


def big_prompt(url: str) -> str:
    return _post(url + "/generate", {"text": "the lighthouse keeper " * (31_500_000 // 22),
                                     "sampling_params": {"max_new_tokens": 1}})


def many_sequences(url: str) -> str:
    return _post(url + "/v1/completions", {"prompt": [f"p{i}" for i in range(1000)],
                                           "n": 128, "max_tokens": 1})


def _half_headers(port: int, count: int, hold: float) -> str:
    conns: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                conns.append(s)
            except OSError:
                break
        time.sleep(hold)
        closed = sum(_closed(s) for s in conns)
        return f"{len(conns)} open, {closed} closed by server"
    finally:
        for s in conns:
            s.close()


def _closed(s: socket.socket) -> bool:
    s.settimeout(0.001)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def run_attack(server: ServerProcess, name: str, attack: Callable[[], str]) -> list[Any]:
    with Probe(server.url, server.proc.pid) as probe:
        start = time.perf_counter()
        outcome = attack()
        seconds = time.perf_counter() - start
        time.sleep(0.5)  # a few probes after the attack too
    lat = np.asarray(probe.latencies or [float("nan")]) * 1000
    return [name, outcome, round(seconds, 2), float(np.median(lat)),
            float(np.percentile(lat, 99)), float(lat.max()), probe.failures,
            round(probe.peak_rss / 2**20), probe.peak_fds]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attacks", nargs="+", default=["baseline", "big_prompt", "many_sequences",
                                                    "slow_headers", "connection_flood"])
    args = p.parse_args()
    server = ServerProcess(server_flags(), env={"JAX_PLATFORMS": "cpu"})
    attacks: dict[str, Callable[[], str]] = {
        "baseline": lambda: (time.sleep(3), "-")[1],
        "big_prompt": lambda: big_prompt(server.url),
        "many_sequences": lambda: many_sequences(server.url),
        "slow_headers": lambda: _half_headers(server.port, 2000, 15.0),
        "connection_flood": lambda: _half_headers(server.port, 10_000, 2.0),
    }
    try:
        rows = [run_attack(server, name, attacks[name]) for name in args.attacks]
    finally:
        server.stop()
    print(machine_description())
    print(markdown_table(["attack", "outcome", "attack s", "/health p50 ms", "p99 ms",
                          "max ms", "failed probes", "peak RSS MiB", "peak open files"], rows))


if __name__ == "__main__":
    main()
