"""Two replicas of the bundled model behind SGLang's router (sglang-router 0.3.2, the pinned
test extra), with the cache_aware and round_robin policies; all real processes over HTTP.

The replicas run with --return-routed-experts-default, the mechanism that carries routed
experts through this router: it re-serialises /generate and chat bodies in SGLang's schema,
dropping return_routed_experts, and forwards no custom header (docs/scaling.md). Through the
router, outputs and routed rows must equal a direct request to a replica, streaming or not;
a replica killed with requests in flight must cost no request and run none twice.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import server_flags
from tests.router_utils import (
    RouterProcess,
    replicas_fixture,
    show_logs_if_failed,
    start_replicas,
    wait_for,
)
from tests.server_utils import sse_events

pytest.importorskip("sglang_router", reason="needs the test extra (sglang-router)")

REPLICA_FLAGS = server_flags(enable_return_routed_experts=True,
                             return_routed_experts_default=True, log_level="warning")
GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = ["The experts of a mixture", "Routing tokens to experts", "A load balancer in front",
           "Replicas of one model"]
HEADER = "X-Return-Routed-Experts"
# Rolling restarts (docs/reliability.md): the router checks /health every second and takes a
# replica out at its first 503 "draining"; requests that reach a draining replica (503) or a
# stopped one (connection refused) are retried on another (sglang-router's default retries).
ROUTER_DRAIN_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


@pytest.fixture(scope="module")
def replicas(request):
    yield from replicas_fixture(request, REPLICA_FLAGS, 2)


@pytest.fixture(scope="module")
def model(replicas) -> str:
    return replicas[0].get("/get_model_info").json()["served_model_name"]


@pytest.fixture(scope="module", params=["cache_aware", "round_robin"])
def router(request, replicas):
    failed_before = request.session.testsfailed
    proc = RouterProcess([r.url for r in replicas], request.param)
    try:
        yield proc
    finally:
        proc.stop()
        show_logs_if_failed(request, failed_before, [proc])


def generated(server) -> int:
    return server.get("/get_server_info").json()["num_generated_tokens"]


def ok(res) -> dict:
    assert res.status_code == 200, res.text
    return res.json()


def stream_events(res) -> list:
    assert res.status_code == 200, res.text
    # The router answers "text/event-stream" without our "; charset=utf-8"; requests would
    # then decode latin-1. An event stream is UTF-8 by definition (what SSE clients assume).
    res.encoding = "utf-8"
    return sse_events(res)


def join_native(events: list) -> dict:
    """One /generate result from its stream: text and ids joined, and the routed rows of every
    chunk (each brings the rows completed since the previous one, from routed_experts_start)."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    parts = []
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["routed_experts_start"] == sum(len(p) for p in parts)
        parts.append(extract_routed_experts_from_meta_info(chunk))
    return {"text": "".join(c["text"] for c in chunks),
            "output_ids": sum((c["output_ids"] for c in chunks), []),
            "rows": np.concatenate(parts)}


def join_chat(events: list) -> dict:
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    parts, pos = [], 0
    for choice in choices:
        meta = choice.get("meta_info") or {}
        if "routed_experts" in meta:
            assert meta["routed_experts_start"] == pos
            parts.append(extract_routed_experts_from_meta_info(meta))
            pos += len(parts[-1])
    return {"content": "".join(c["delta"].get("content", "") for c in choices),
            "finish_reason": choices[-1]["finish_reason"], "rows": np.concatenate(parts)}


def test_router_sees_the_replicas_their_model_and_load(router, model):
    workers = router.workers()
    assert len(workers) == 2 and all(w["is_healthy"] for w in workers)
    # /model_info gives the router the served model name as the workers' model id.
    assert {w["model_id"] for w in workers} == {model}
    assert [m["id"] for m in ok(router.get("/v1/models"))["data"]] == [model]
    # /get_load in SGLang's shape: the router reads it (-1 when it cannot).
    assert all(w["load"] >= 0 for w in ok(router.get("/get_loads"))["workers"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_through_the_router_equals_a_direct_request(router, replicas, stream):
    before = [generated(r) for r in replicas]
    bodies = [{"text": p, "sampling_params": GREEDY} for p in PROMPTS]
    # SGLang's seed spelling: the router drops an unknown "seed" inside sampling_params.
    bodies.append({"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 1234}})
    for body in bodies:
        direct = ok(replicas[0].post("/generate", json=body))
        want = extract_routed_experts_from_meta_info(direct)
        assert want.shape[0] == sum(direct["meta_info"][k]
                                    for k in ("prompt_tokens", "completion_tokens")) - 1
        if stream:
            res = router.post("/generate", json={**body, "stream": True}, stream=True)
            got = join_native(stream_events(res))
        else:
            out = ok(router.post("/generate", json=body))
            got = {**out, "rows": extract_routed_experts_from_meta_info(out)}
        assert (got["text"], got["output_ids"]) == (direct["text"], direct["output_ids"])
        np.testing.assert_array_equal(got["rows"], want)
    if router.policy == "round_robin":  # both replicas served some
        assert all(generated(r) > b for r, b in zip(replicas, before, strict=True))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_through_the_router_equals_a_direct_request(router, replicas, model, stream):
    for prompt in PROMPTS[:2]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8, "temperature": 0}
        direct = ok(replicas[0].post("/v1/chat/completions", json=body))["choices"][0]
        want = extract_routed_experts_from_meta_info(direct)
        if stream:
            res = router.post("/v1/chat/completions", json={**body, "stream": True},
                              stream=True)
            got = join_chat(stream_events(res))
        else:
            choice = ok(router.post("/v1/chat/completions", json=body))["choices"][0]
            got = {"content": choice["message"]["content"],
                   "finish_reason": choice["finish_reason"],
                   "rows": extract_routed_experts_from_meta_info(choice)}
        assert got["content"] == direct["message"]["content"]
        assert got["finish_reason"] == direct["finish_reason"]
        np.testing.assert_array_equal(got["rows"], want)


def test_what_reaches_a_replica_through_the_router(router, replicas, model):
    """The findings of docs/scaling.md, pinned: the router drops return_routed_experts from
    /generate and chat bodies and drops the header, so only the server default reaches the
    replica there; /v1/completions bodies keep it. Directly, body and header both work."""
    replica = replicas[0]
    off = {"text": PROMPTS[1], "sampling_params": GREEDY, "return_routed_experts": False}

    def rows(res) -> np.ndarray | None:
        out = ok(res)
        return extract_routed_experts_from_meta_info(out["choices"][0] if "choices" in out
                                                     else out)

    assert rows(replica.post("/generate", json=off)) is None
    assert rows(router.post("/generate", json=off)) is not None  # field dropped
    plain = {"text": PROMPTS[1], "sampling_params": GREEDY}
    assert rows(replica.post("/generate", json=plain, headers={HEADER: "0"})) is None
    assert rows(router.post("/generate", json=plain, headers={HEADER: "0"})) is not None
    assert rows(replica.post("/generate", json=off, headers={HEADER: "1"})) is None  # body wins
    bad = replica.post("/generate", json=plain, headers={HEADER: "maybe"})
    assert bad.status_code == 400 and HEADER in bad.json()["error"]["message"]

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "return_routed_experts": False}
    assert rows(replica.post("/v1/chat/completions", json=chat)) is None
    assert rows(router.post("/v1/chat/completions", json=chat)) is not None  # field dropped
    completion = {"model": model, "prompt": "hi", "max_tokens": 4,
                  "return_routed_experts": False}
    assert rows(router.post("/v1/completions", json=completion)) is None  # forwarded
    assert rows(router.post("/v1/completions", json={**completion,
                                                     "return_routed_experts": True})) is not None


def test_sglang_fields_through_the_router(router, replicas):
    """The router's own additions are accepted (every request above carried them); a field
    asking for what we do not do comes back as a 400 naming it, not retried elsewhere."""
    for via in (router, replicas[0]):
        res = via.post("/generate", json={"text": "x", "sampling_params": GREEDY,
                                          "return_hidden_states": True})
        assert res.status_code == 400, res.text
        assert res.json()["error"]["param"] == "return_hidden_states"
    res = router.post("/generate", json={"text": "x", "model": "another-model"})
    assert res.status_code == 404 and res.json()["error"]["param"] == "model"


def test_a_replica_killed_mid_run_loses_no_request_and_runs_none_twice(request, replicas):
    """Round robin over a survivor and a fresh replica; the fresh one is SIGKILLed with its
    share of eight long requests in flight. The router retries those on the survivor: every
    request answers once with the direct answer, and the survivor generates exactly the
    tokens of the eight (a request run twice there would add its tokens again)."""
    survivor = replicas[0]
    failed_before = request.session.testsfailed
    [victim] = start_replicas(REPLICA_FLAGS, 1)
    router = RouterProcess([survivor.url, victim.url], "round_robin", extra=[
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1"])
    try:
        params = {"max_new_tokens": 192, "temperature": 0, "ignore_eos": True}
        bodies = [{"text": f"request {i}: {PROMPTS[i % 4]}", "sampling_params": params}
                  for i in range(8)]
        start = generated(survivor)
        direct = [ok(survivor.post("/generate", json=b)) for b in bodies]
        tokens_of_eight = generated(survivor) - start
        assert tokens_of_eight == 8 * 192

        def load(server) -> int:
            return ok(server.get("/get_load"))[0]["num_reqs"]

        answers: list = [None] * 8

        def send(i: int) -> None:
            answers[i] = router.post("/generate", json=bodies[i], timeout=120)

        start = generated(survivor)
        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: load(survivor) + load(victim) == 8, 30, "all 8 requests running")
        in_flight = load(victim)
        victim.kill()
        assert in_flight > 0
        for t in threads:
            t.join(120)
        for answer, want in zip(answers, direct, strict=True):
            got = ok(answer)
            assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"])
            np.testing.assert_array_equal(extract_routed_experts_from_meta_info(got),
                                          extract_routed_experts_from_meta_info(want))
        assert generated(survivor) - start == tokens_of_eight
        # The health checker takes the dead replica out; requests keep being served.
        wait_for(lambda: router.healthy_workers() == 1, 15, "the router to mark it unhealthy")
        assert ok(router.get("/readiness"))["healthy_workers"] == 1
        ok(router.post("/generate", json={"text": "still there", "sampling_params": GREEDY}))
    finally:
        router.stop()
        victim.stop()
        show_logs_if_failed(request, failed_before, [router, victim])


def test_a_replica_restarted_with_sigterm_under_load_loses_no_request(request, replicas):
    """The rolling-restart case (docs/reliability.md: graceful drain): steady load through the
    router, one replica gets SIGTERM mid-run. It finishes what it runs (its /health answers
    503 "draining", new requests that reach it get 503 and the router retries them on the
    other replica), then exits 0. Every request answers 200 with the direct answer: zero
    failed requests."""
    survivor = replicas[0]
    failed_before = request.session.testsfailed
    [victim] = start_replicas(REPLICA_FLAGS, 1)
    router = RouterProcess([survivor.url, victim.url], "round_robin", extra=ROUTER_DRAIN_FLAGS)
    try:
        params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
        clients, per_client = 4, 8
        bodies = [[{"text": f"client {c} request {k}: {PROMPTS[(c + k) % 4]}",
                    "sampling_params": params} for k in range(per_client)]
                  for c in range(clients)]
        direct = {(c, k): ok(survivor.post("/generate", json=b))
                  for c in range(clients) for k, b in enumerate(bodies[c])}
        answers: dict[tuple[int, int], object] = {}
        victim_started = threading.Event()

        def client(c: int) -> None:
            for k, body in enumerate(bodies[c]):
                try:
                    answers[c, k] = router.post("/generate", json=body, timeout=120)
                except Exception as e:  # noqa: BLE001 - counted as a failed request
                    answers[c, k] = e
                if k == 1:
                    victim_started.set()

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        victim_started.wait(60)
        wait_for(lambda: ok(victim.get("/get_load"))[0]["num_reqs"] > 0, 30,
                 "requests running on the victim")
        victim.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(180)
        assert victim.proc.wait(60) == 0
        failed = []
        for key, want in direct.items():
            got = answers.get(key)
            if not (hasattr(got, "status_code") and got.status_code == 200):
                failed.append((key, getattr(got, "status_code", got),
                               getattr(got, "text", "")[:200]))
                continue
            out = got.json()
            assert (out["text"], out["output_ids"]) == (want["text"], want["output_ids"]), key
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            np.testing.assert_array_equal(extract_routed_experts_from_meta_info(out),
                                          extract_routed_experts_from_meta_info(want))
        assert failed == [], failed
        # (At --log-level warning the victim logs each 503 "draining" it answered, not the
        # drain itself; how many reached it depends on the health check's timing.)
        wait_for(lambda: router.healthy_workers() == 1, 15, "the router to mark it unhealthy")
        ok(router.post("/generate", json={"text": "after the restart",
                                          "sampling_params": GREEDY}))
    finally:
        router.stop()
        victim.stop()
        show_logs_if_failed(request, failed_before, [router, victim])
