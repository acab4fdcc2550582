"""Trust and availability of the HTTP server (M16, docs/security.md): the admin key, bounded
echoes, requests refused before any work, idle connections that cannot hold the server, one
integer rule on every surface, and a rid free for reuse as soon as it is aborted.

Each attack here was reproduced against the server before it was fixed (the issue's figures:
a 31.5 MB prompt stalled /health 31-36 s; 1,000 prompts x n=128 ran 77 s; 2,000 header-less
connections stayed open past 65 s; a 1 MiB weight_version was echoed in every response). The
tests check the outcome and that /health answers meanwhile; the latencies are measured by
benchmarks/bench_health_under_attack.py (docs/reliability.md).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
import requests

from sgl_jax import Engine
from sgl_jax.srt.entrypoints.http_server import ADMIN_PATHS
from sgl_jax.testing import ServerProcess, engine_args, server_flags, wait_until
from tests.server_utils import CPU_ENV, server_fixture, sse_events

USER, ADMIN = "user-key", "admin-key"
HEADER_TIMEOUT, MAX_CONNECTIONS = 2.0, 300
ARGS = server_flags(admin_api_key=ADMIN, http_header_timeout=HEADER_TIMEOUT,
                    http_max_connections=MAX_CONNECTIONS, max_prompts_per_request=64)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    yield from server_fixture(request, ARGS, api_key=USER)


def call(server: ServerProcess, path: str, key: str | None, body: Any = None,
         method: str = "post", **kw: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.request(method, server.url + path, json=body, headers=headers,
                            timeout=kw.pop("timeout", 60), **kw)


def generate(server: ServerProcess, key: str = USER, **body: Any) -> requests.Response:
    body.setdefault("input_ids", [5, 6, 7])
    body.setdefault("sampling_params", {"max_new_tokens": 2, "temperature": 0})
    return call(server, "/generate", key, body)


def error_of(res: requests.Response) -> dict[str, Any]:
    return res.json()["error"]


class HealthProbe:
    """Polls /health every 50 ms in a thread while an attack runs: the slowest answer, and
    whether every probe got a 200."""

    def __init__(self, server: ServerProcess) -> None:
        self.url, self.latencies, self.failures = server.url + "/health", [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                status = requests.get(self.url, timeout=10).status_code
            except requests.RequestException as e:
                status = repr(e)
            self.latencies.append(time.perf_counter() - start)
            if status != 200:
                self.failures.append(status)
            self._stop.wait(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(15)

    def assert_served(self) -> None:
        assert self.latencies and not self.failures, self.failures[:3]
        # Generous (CI machines are noisy); the benchmark measures the real figure.
        assert max(self.latencies) < 5.0, max(self.latencies)


# -- keys -----------------------------------------------------------------------------------
ADMIN_BODIES = {"/update_weights_from_disk": {"model_path": "/nonexistent"},
                "/abort_request": {"rid": "nobody"}}


@pytest.mark.parametrize("path", sorted(ADMIN_PATHS))
def test_admin_routes_need_the_admin_key(server, path):
    body = ADMIN_BODIES.get(path)
    res = call(server, path, None, body)
    assert res.status_code == 401 and error_of(res)["code"] == "invalid_api_key"
    res = call(server, path, USER, body)
    assert res.status_code == 403, res.text
    assert error_of(res)["code"] == "admin_key_required" and "--admin-api-key" in res.text
    res = call(server, path, ADMIN, body)
    # Past the keys: the route itself answers (a 400 for a recorder that is off, say).
    assert res.status_code not in (401, 403), res.text
    if path == "/pause_generation":
        assert call(server, "/continue_generation", ADMIN).status_code == 200
    if path == "/release_memory_occupation":
        assert call(server, "/resume_memory_occupation", ADMIN).status_code == 200
    assert generate(server).status_code == 200  # and the server serves on


def test_user_routes_take_either_key_and_health_takes_none(server):
    assert generate(server, key=USER).status_code == 200
    assert generate(server, key=ADMIN).status_code == 200
    assert generate(server, key="wrong").status_code == 401
    assert call(server, "/v1/models", None, method="get").status_code == 401
    assert call(server, "/health", None, method="get").status_code == 200


def test_secrets_are_not_shown(server):
    info = call(server, "/get_server_info", USER, method="get").json()["server_args"]
    assert info["api_key"] == info["admin_api_key"] == "<redacted>"
    assert ADMIN not in server.log() and USER not in server.log()


def test_the_same_key_for_both_is_refused_at_start():
    with pytest.raises(RuntimeError, match="api_key and admin_api_key are the same"):
        ServerProcess(server_flags(admin_api_key="k"), api_key="k", env=CPU_ENV,
                      startup_timeout=60)


# -- bounded echoes -------------------------------------------------------------------------
@pytest.mark.parametrize("version,why", [("v" * (1 << 20), "1048576 characters"),
                                         ("v" * 129, "129 characters"),
                                         ("v1\n", "control characters"), ("", "0 characters")])
def test_weight_version_is_bounded(server, version, why):
    model_path = call(server, "/get_model_info", USER, method="get").json()["model_path"]
    res = call(server, "/update_weights_from_disk", ADMIN,
               {"model_path": model_path, "weight_version": version})
    assert res.status_code == 400, res.text
    error = error_of(res)
    assert error["param"] == "weight_version" and why in error["message"]
    assert len(res.content) < 1024
    # Nothing was updated: responses still carry the old version.
    assert generate(server).json()["meta_info"]["weight_version"] == "0"


@pytest.mark.parametrize("body,param", [
    ({"rid": "r" * 257}, "rid"),
    ({"rid": "a\x00b"}, "rid"),
    ({"model": "m" * (1 << 20)}, "model"),
    ({"k" * (1 << 20): 1}, "k" * 97 + "..."),  # an unknown key is named, shortened
])
def test_echoed_strings_are_bounded(server, body, param):
    res = generate(server, **body)
    assert res.status_code in (400, 404), res.text
    assert error_of(res)["param"] == param and len(res.content) < 1024


# -- refused before any work ------------------------------------------------------------------
def test_a_huge_prompt_is_refused_without_tokenizing(server):
    proc = psutil.Process(server.proc.pid)
    rss_before = proc.memory_info().rss
    text = "the lighthouse keeper " * (31_500_000 // 22)  # 31.5 MB, under the 32 MiB body limit
    with HealthProbe(server) as probe:
        for route, body in (("/generate", {"text": text}),
                            ("/v1/completions", {"prompt": text}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": text}]})):
            res = call(server, route, USER, body)
            assert res.status_code == 400, (route, res.text[:300])
            assert "cannot fit the context length" in error_of(res)["message"]
    probe.assert_served()
    # No tokenization: the server keeps little of the attack (it kept 3.3-3.7 GB).
    assert proc.memory_info().rss - rss_before < 400 * 2**20
    with HealthProbe(server) as probe:
        ids = [7] * 3_000_000  # as token ids, echoed: refused before the echo decodes them
        res = call(server, "/v1/completions", USER, {"prompt": ids, "echo": True})
        assert res.status_code == 400 and "3000000 tokens" in error_of(res)["message"]
    probe.assert_served()


def test_prompts_times_n_is_capped(server):
    prompts = [f"prompt {i}" for i in range(1000)]
    with HealthProbe(server) as probe:
        res = call(server, "/v1/completions", USER, {"prompt": prompts, "n": 128,
                                                     "max_tokens": 1})
    probe.assert_served()
    assert res.status_code == 400 and error_of(res)["param"] == "n"
    assert "128000" in error_of(res)["message"] and "--max-prompts-per-request" in res.text
    res = generate(server, input_ids=[[1, 2]] * 65)  # the native batch too
    assert res.status_code == 400 and "65 prompts" in error_of(res)["message"]
    res = call(server, "/v1/completions", USER, {"prompt": ["a", "b"], "n": 32, "max_tokens": 1})
    assert res.status_code == 200 and len(res.json()["choices"]) == 64  # at the cap: served


def test_stop_token_ids_and_stop_strings_are_bounded(server):
    for params, needle in (({"stop_token_ids": [1] * 257}, "at most 256"),
                           ({"stop": "x" * 1025}, "at most 1024 characters")):
        res = generate(server, sampling_params={"max_new_tokens": 1, **params})
        assert res.status_code == 400 and needle in error_of(res)["message"], res.text


def test_the_engine_caller_is_not_capped():
    """The cap is for HTTP clients; an RL trainer batches thousands of rollouts in-process."""
    with Engine(**engine_args(max_prompts_per_request=2)) as engine:
        out = engine.generate(input_ids=[[5, 6], [7, 8], [9, 10]],
                              sampling_params={"max_new_tokens": 1})
    assert len(out) == 3 and all(o["meta_info"]["completion_tokens"] == 1 for o in out)


# -- integers, strictly, everywhere -------------------------------------------------------------
@pytest.mark.parametrize("route,body,param", [
    ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 100.0}},
     "max_new_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4.0}, "max_tokens"),
])
def test_integral_floats_are_refused_on_every_route(server, route, body, param):
    res = call(server, route, USER, body)
    assert res.status_code == 400 and param in error_of(res)["message"], res.text


# -- connections ------------------------------------------------------------------------------
def _open_slow_connections(server: ServerProcess, count: int) -> list[socket.socket]:
    """Connections that send the start of a request and then nothing (slowloris)."""
    conns = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        conns.append(s)
    return conns


def _closed_by_server(conn: socket.socket) -> bool:
    """True once the server closed ``conn`` (what it sent before is read and dropped)."""
    conn.settimeout(0.01)
    try:
        while conn.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_idle_connections_cannot_hold_the_server(server):
    proc = psutil.Process(server.proc.pid)
    fds_before = proc.num_fds()
    with HealthProbe(server) as probe:
        conns = _open_slow_connections(server, 2000)
        try:
            # The cap holds: the server keeps at most MAX_CONNECTIONS of them open.
            assert proc.num_fds() < fds_before + MAX_CONNECTIONS + 50
            assert generate(server).status_code == 200
            # The header deadline closes the rest.
            assert wait_until(lambda: all(_closed_by_server(c) for c in conns),
                              timeout=HEADER_TIMEOUT + 10, interval=0.5)
        finally:
            for c in conns:
                c.close()
    probe.assert_served()


def test_a_kept_alive_connection_must_send_its_next_headers_in_time(server):
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        auth = f"Authorization: Bearer {USER}\r\n".encode()
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200")
        assert not _closed_by_server(conn)  # kept alive
        conn.sendall(b"GET /v1/models HTTP/1.1\r\n")  # the next request, never finished
        assert wait_until(lambda: _closed_by_server(conn), timeout=HEADER_TIMEOUT + 10)
    finally:
        conn.close()


# -- rid reuse ---------------------------------------------------------------------------------
def _stream_first_chunk(server: ServerProcess, rid: str) -> Callable[[], list]:
    res = requests.post(server.url + "/generate", stream=True, timeout=60,
                        headers={"Authorization": f"Bearer {USER}"},
                        json={"input_ids": [9, 8, 7], "rid": rid, "stream": True,
                              "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}})
    lines = res.iter_lines(decode_unicode=True)
    next(line for line in lines if line)
    return lambda: sse_events(lines)


def test_a_rid_is_free_as_soon_as_it_is_aborted(server):
    for attempt in range(8):
        rid = f"reuse-{attempt}"
        rest = _stream_first_chunk(server, rid)
        res = call(server, "/abort_request", ADMIN, {"rid": rid})
        assert res.json()["success"] is True
        again = generate(server, rid=rid)
        assert again.status_code == 200, (attempt, again.text)
        assert again.json()["meta_info"]["id"] == rid
        events = rest()
        assert events[-1] == "[DONE]"
        assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
