"""Prometheus metrics (--enable-metrics) and request logging (--log-requests), end to end.

One real server with an API key, routed experts, metrics, request logging and the expert
distribution recorder: requests over the native and OpenAI routes, streamed and not, then a
scrape of /metrics parsed by prometheus_client's own parser. The counters must equal what the
responses report (usage, meta_info, decoded routed-experts payloads), the histograms hold one
observation per request (per generated token after the first for inter-token latency), and the
log has one line per request and never the prompt. /metrics without --enable-metrics is a 404
(tests/test_drain.py's servers).
"""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sgl_jax.testing import server_flags
from tests.server_utils import server_fixture, sse_events

pytest.importorskip("prometheus_client")

API_KEY = "metrics-key"
ARGS = server_flags(enable_return_routed_experts=True, enable_metrics=True, log_requests=True,
                    expert_distribution_recorder_mode="stat")
SECRET_PROMPT = "zebra violin umbrella"  # must never reach the log


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, ARGS, api_key=API_KEY)


def scrape(server) -> dict[str, dict]:
    """{family name: {"type": ..., "samples": [(name, labels, value)]}} from /metrics."""
    res = server.get("/metrics")
    assert res.status_code == 200, res.text
    assert res.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(res.text):
        out[family.name] = {"type": family.type,
                            "samples": [(s.name, s.labels, s.value) for s in family.samples]}
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """The one sample of ``family`` named ``sample`` (default: the family's own, ``_total``
    for a counter) with ``labels``."""
    if sample is None:
        sample = family + "_total" if metrics[family]["type"] == "counter" else family
    hits = [v for name, lab, v in metrics[family]["samples"]
            if name == sample and all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (family, sample, labels, metrics[family]["samples"])
    return hits[0]


def payload_bytes(meta: dict) -> int:
    total = 0
    for key in ("routed_experts", "prompt_routed_experts"):
        if meta.get(key):
            total += len(base64.b64decode(meta[key]))
    return total


def test_metrics_need_the_api_key(server):
    res = requests.get(server.url + "/metrics", timeout=10)
    assert res.status_code == 401
    assert res.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_counters_and_histograms_equal_what_the_requests_used(server):
    before = scrape(server)
    base = {name: value(before, fam) for name, fam in (
        ("prompt", "sglang:prompt_tokens"), ("gen", "sglang:generation_tokens"),
        ("cached", "sglang:cached_tokens"), ("routed", "sglang_jax:routed_experts_bytes"),
        ("reqs", "sglang:num_requests"))}
    base["ttft"] = value(before, "sglang:time_to_first_token_seconds",
                         "sglang:time_to_first_token_seconds_count")
    base["e2e"] = value(before, "sglang:e2e_request_latency_seconds",
                        "sglang:e2e_request_latency_seconds_count")
    base["itl"] = value(before, "sglang:inter_token_latency_seconds",
                        "sglang:inter_token_latency_seconds_count")

    prompt = gen = cached = routed = 0
    itl = 0
    reasons: dict[str, int] = {}

    def account(meta: dict, finish: str) -> None:
        nonlocal prompt, gen, cached, itl
        prompt += meta["prompt_tokens"]
        gen += meta["completion_tokens"]
        cached += meta["cached_tokens"]
        itl += meta["completion_tokens"] - 1
        reasons[finish] = reasons.get(finish, 0) + 1

    text = f"{SECRET_PROMPT} and the experts of a mixture, twice over"
    # native, whole, routed experts; the same prompt twice: the second hits the prefix cache
    for _ in range(2):
        out = server.post("/generate", json={
            "text": text, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        routed += payload_bytes(out["meta_info"])
        account(out["meta_info"], out["meta_info"]["finish_reason"]["type"])
    assert out["meta_info"]["cached_tokens"] > 0
    # native, streamed, routed experts: rows arrive chunk by chunk
    res = server.post("/generate", stream=True, json={
        "text": "Streaming routed experts", "return_routed_experts": True, "stream": True,
        "sampling_params": {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}})
    events = sse_events(res)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        routed += payload_bytes(chunk["meta_info"])
    account(events[-2]["meta_info"], events[-2]["meta_info"]["finish_reason"]["type"])
    # OpenAI completions, no routed experts: usage carries the counts
    body = server.post("/v1/completions", json={
        "prompt": "OpenAI route", "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    usage = body["usage"]
    account({"prompt_tokens": usage["prompt_tokens"],
             "completion_tokens": usage["completion_tokens"],
             "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            body["choices"][0]["finish_reason"])
    # a one-token request (no inter-token interval)
    out = server.post("/generate", json={
        "text": "just one", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    account(out["meta_info"], out["meta_info"]["finish_reason"]["type"])
    n = 5
    assert routed > 0

    after = scrape(server)
    assert after["sglang:prompt_tokens"]["type"] == "counter"
    assert value(after, "sglang:prompt_tokens") - base["prompt"] == prompt
    assert value(after, "sglang:generation_tokens") - base["gen"] == gen
    assert value(after, "sglang:cached_tokens") - base["cached"] == cached > 0
    assert value(after, "sglang_jax:routed_experts_bytes") - base["routed"] == routed
    assert value(after, "sglang:num_requests") - base["reqs"] == n
    for reason, count in reasons.items():
        got = value(after, "sglang_jax:finished_requests", finish_reason=reason)
        was = [v for name, lab, v in before["sglang_jax:finished_requests"]["samples"]
               if lab.get("finish_reason") == reason]
        assert got - sum(was) == count, reason
    assert after["sglang:time_to_first_token_seconds"]["type"] == "histogram"
    for family, key in (("sglang:time_to_first_token_seconds", "ttft"),
                        ("sglang:e2e_request_latency_seconds", "e2e")):
        assert value(after, family, family + "_count") - base[key] == n
        assert value(after, family, family + "_sum") > 0
    itl_family = "sglang:inter_token_latency_seconds"
    assert value(after, itl_family, itl_family + "_count") - base["itl"] == itl
    buckets = [(float(lab["le"]), v) for name, lab, v in after[itl_family]["samples"]
               if name.endswith("_bucket")]
    assert buckets[-1] == (float("inf"), value(after, itl_family, itl_family + "_count"))
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))  # cumulative
    # Idle: nothing runs or waits, and no KV is held by a request (the cache may keep some).
    assert value(after, "sglang:num_running_reqs") == 0
    assert value(after, "sglang:num_queue_reqs") == 0
    assert value(after, "sglang:token_usage") == 0
    total_prompt, total_cached = (value(after, "sglang:prompt_tokens"),
                                  value(after, "sglang:cached_tokens"))
    assert value(after, "sglang:cache_hit_rate") == pytest.approx(total_cached / total_prompt)
    for family in after.values():  # every series says which model
        assert all("model_name" in lab for _, lab, _ in family["samples"])


def test_gauges_see_running_requests(server):
    """While a long request decodes, the scrape sees it running and holding KV."""
    import threading

    done = {}
    thread = threading.Thread(target=lambda: done.update(res=server.post("/generate", json={
        "text": "a long one", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}})))
    thread.start()
    try:
        for _ in range(200):
            metrics = scrape(server)
            if value(metrics, "sglang:num_running_reqs") == 1:
                break
        assert value(metrics, "sglang:num_running_reqs") == 1
        assert value(metrics, "sglang:num_used_tokens") > 0
        assert 0 < value(metrics, "sglang:token_usage") <= 1
    finally:
        thread.join(60)
    assert done["res"].status_code == 200


def test_expert_load_imbalance_while_the_recorder_runs(server):
    assert "sglang_jax:expert_load_imbalance" not in scrape(server) or not scrape(server)[
        "sglang_jax:expert_load_imbalance"]["samples"]
    assert server.post("/start_expert_distribution_record").status_code == 200
    try:
        for prompt in ("imbalance one", "imbalance two, a little longer"):
            assert server.post("/generate", json={
                "text": prompt, "sampling_params": {"max_new_tokens": 4}}).status_code == 200
        metrics = scrape(server)
        load = server.get("/expert_load").json()
    finally:
        server.post("/stop_expert_distribution_record")
    counts = np.asarray(load["counts"], np.float64)
    want = {str(layer): row.max() / row.mean()
            for layer, row in zip(load["moe_layers"], counts, strict=True)}
    got = {lab["layer"]: v for _, lab, v in
           metrics["sglang_jax:expert_load_imbalance"]["samples"]}
    assert got.keys() == want.keys() and len(got) == len(load["moe_layers"]) > 0
    for layer, ratio in want.items():
        assert got[layer] == pytest.approx(ratio)
        assert ratio >= 1
    # Stopped: the gauge goes away with the recording.
    after = scrape(server)
    assert not after.get("sglang_jax:expert_load_imbalance", {"samples": []})["samples"]


def test_log_requests_writes_one_line_per_request_without_the_prompt(server):
    rid = "log-me-7"
    out = server.post("/generate", json={
        "text": SECRET_PROMPT, "rid": rid, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}).json()
    meta = out["meta_info"]
    log = server.log()
    lines = [line for line in log.splitlines() if f"request {rid} finished" in line]
    assert len(lines) == 1, log[-3000:]
    line = lines[0]
    assert re.search(rf"prompt_tokens={meta['prompt_tokens']} completion_tokens=3 "
                     rf"cached_tokens={meta['cached_tokens']} finish_reason=length "
                     r"e2e_latency=\d+\.\d+s routed_experts_rows=\d+", line), line
    rows = int(line.rsplit("=", 1)[1])
    assert rows == meta["prompt_tokens"] + 3 - 1
    assert SECRET_PROMPT not in log and "zebra" not in log
