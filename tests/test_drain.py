"""Graceful drain on SIGTERM (--graceful-shutdown-timeout), end to end on real servers.

SIGTERM with requests running and queued: every one of them finishes with its whole output
(finish reason length, the same tokens and routed experts as before the signal), streams
included; meanwhile a new request gets a 503 "draining" and /health a 503 saying "draining";
then the process exits 0. With a short timeout, what is still running at the deadline is
aborted and the process exits 0 all the same. (A second signal stops at once:
tests/test_http_server.py and tests/test_reliability.py.)
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import requests

from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import server_flags, wait_until
from tests.server_utils import sse_events, start_server

ARGS = server_flags(enable_return_routed_experts=True, return_routed_experts_default=True)
NEW = 960  # tokens per request: a few seconds for the batch on a CPU, long enough for the
#           poll below to see all six in flight together (at 160 it missed them once in CI)


def in_flight(server) -> int:
    info = server.get("/get_server_info").json()
    return info["num_running_reqs"] + info["num_waiting_reqs"]


def body(i: int, stream: bool, new: int = NEW) -> dict[str, Any]:
    return {"text": f"drain request {i}: the experts of a mixture", "stream": stream,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}


def joined(res: requests.Response, stream: bool) -> dict[str, Any]:
    """One native result from a response, streamed or not: ids, finish reason, rows."""
    assert res.status_code == 200, res.text
    if not stream:
        out = res.json()
        return {"ids": out["output_ids"], "finish": out["meta_info"]["finish_reason"]["type"],
                "rows": extract_routed_experts_from_meta_info(out)}
    events = sse_events(res)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    rows = [r for r in map(extract_routed_experts_from_meta_info, chunks) if r is not None]
    return {"ids": sum((c["output_ids"] for c in chunks), []),
            "finish": chunks[-1]["meta_info"]["finish_reason"]["type"],
            "rows": np.concatenate(rows) if rows else None}


def send_all(server, bodies: list[dict]) -> tuple[list[threading.Thread], dict[int, Any]]:
    outcomes: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            res = server.post("/generate", json=bodies[i], stream=bodies[i]["stream"],
                              timeout=120)
            outcomes[i] = joined(res, bodies[i]["stream"])
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    return threads, outcomes


def test_sigterm_drains_running_and_queued_requests_then_exits_zero():
    server = start_server(ARGS)
    try:
        # Off by default: no route, nothing recorded.
        assert server.get("/metrics").status_code == 404
        # Six requests, four request slots: two of them wait in the queue at the signal.
        bodies = [body(i, stream=i % 2 == 0) for i in range(6)]
        want = [joined(server.post("/generate", json={**b, "stream": False}), False)
                for b in bodies]
        threads, outcomes = send_all(server, bodies)
        assert wait_until(lambda: in_flight(server) == 6, timeout=20)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # Draining: the replica says so and refuses new work, on every generation route.
        assert wait_until(lambda: server.get("/health").status_code == 503, timeout=5)
        health = server.get("/health")
        assert health.json()["status"] == "draining", health.text
        assert "draining" in health.json()["error"]["message"]
        for route, payload in (("/generate", body(99, False, 4)),
                               ("/v1/completions", {"prompt": "new", "max_tokens": 4}),
                               ("/generate", body(98, True, 4))):
            res = server.post(route, json=payload)
            assert res.status_code == 503, (route, res.text)
            error = res.json()["error"]
            assert error["code"] == "draining" and error["type"] == "server_error", error
        assert in_flight(server) > 0  # the old ones still run meanwhile
        for t in threads:
            t.join(120)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
        assert code == 0, server.log()[-3000:]
        for i, (got, expected) in enumerate(zip([outcomes[i] for i in range(6)], want,
                                                strict=True)):
            assert isinstance(got, dict), (i, got)
            assert got["finish"] == "length" and len(got["ids"]) == NEW, (i, got["finish"])
            assert got["ids"] == expected["ids"], i
            np.testing.assert_array_equal(got["rows"], expected["rows"])
        log = server.log()
        assert "draining 6 request(s), up to 30 s" in log, log[-3000:]
        assert "drained: every request finished" in log
        assert took < 30
    finally:
        server.stop()


def test_drain_timeout_aborts_what_is_left_and_exits_zero():
    server = start_server(server_flags(enable_return_routed_experts=True,
                                       graceful_shutdown_timeout=2))
    try:
        bodies = [body(i, stream=i == 0, new=3000) for i in range(2)]  # ~10 s each
        threads, outcomes = send_all(server, bodies)
        assert wait_until(lambda: in_flight(server) == 2, timeout=20)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        code = server.proc.wait(30)
        took = time.monotonic() - t0
        assert code == 0, server.log()[-3000:]
        assert 2 <= took < 8, took
        for i in range(2):
            got = outcomes[i]
            assert isinstance(got, dict), (i, got)
            assert got["finish"] == "abort" and 0 < len(got["ids"]) < 3000, (i, got["finish"])
        log = server.log()
        assert "draining 2 request(s), up to 2 s" in log
        assert "drain timed out: aborting 2 request(s)" in log, log[-3000:]
    finally:
        server.stop()
