"""The scheduler with data-parallel attention (M19): one scheduler, DP ranks inside the step.

tests/dp_scheduler_worker.py steps a real Scheduler (dp2 on a tp2 x ep2 mesh of 4 fake CPU
devices, pages of 4, 48 KV tokens per rank) through concurrent requests, chunked prompts, an
idle rank, an abort, a prefix hit, retractions, a request too long for its rank and the
shortest-queue balancer, recording every step. Here: every request's tokens and routed-experts
rows equal the float64 reference; every KV slot a request ever holds is in its rank's range and
its rank never changes; steps hold both ranks at once, per-rank budgets are kept, and nothing
leaks. The same worker's ``engine`` mode serves a batch of concurrent requests (and a prefix
hit) through a whole Engine with that layout: tokens and rows against the reference, both
ranks used, nothing leaked (server_info and its per-rank list).

Today's runner computes a step's rows as one batch over global KV slots (it reads no
``dp_ranks``), so these results are exact whatever the ranks; a runner that computes each
rank on its own KV shard must keep them so, which is what the slot-range checks guarantee.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, fake_devices_flags
from tests.dp_scheduler_worker import CHUNK
from tests.engine_utils import decoded_rows, expected_rows, reference_greedy

REPO = Path(__file__).absolute().parents[1]
RANK_MAX_RUNNING = 2  # ceil(max_running_requests 4 / dp 2)


def _worker(*args: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pkl")
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(4)}
        proc = subprocess.run([sys.executable, "-m", "tests.dp_scheduler_worker", *args, path],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(path, "rb") as f:
            return pickle.load(f)


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    return _worker()


@pytest.fixture(scope="module")
def engine_run() -> dict[str, Any]:
    return _worker("engine")


def steps_of(run: dict[str, Any], name: str) -> list[dict[str, Any]]:
    names = list(run["marks"])
    start = run["marks"][name]
    end = run["marks"][names[names.index(name) + 1]]
    return run["steps"][start:end]


def assert_exact(run: dict[str, Any], rid: str, finish: str = "length") -> list[int]:
    rec, ids = run["records"][rid], run["prompts"][rid]
    assert rec["finished_reason"]["type"] == finish, rec["finished_reason"]
    out = rec["output_ids"]
    assert out == reference_greedy(ids, len(out))
    np.testing.assert_array_equal(rec["routed"], expected_rows(ids, out))
    return out


def test_every_slot_in_its_rank_and_every_request_keeps_its_rank(run):
    assert run["steps"]
    assert [s for s in run["steps"] if s["bad"]] == []
    assert all(len(ranks) == 1 for ranks in run["rank_of"].values()), run["rank_of"]
    for rid, ranks in run["rank_of"].items():
        assert ranks == {run["ranks"][rid]}


def test_per_rank_budgets(run):
    for step in run["steps"]:
        if step["mode"] == "EXTEND":
            assert max(step["tokens"]) <= CHUNK, step
        assert max(step["rows"]) <= RANK_MAX_RUNNING, step


def test_concurrent_requests_on_both_ranks(run):
    assert [run["ranks"][f"c{i}"] for i in range(4)] == [0, 1, 0, 1]  # round robin
    steps = steps_of(run, "concurrent")
    for mode in ("EXTEND", "DECODE"):
        assert any(s["mode"] == mode and min(s["rows"]) > 0 for s in steps), mode
    for i in range(4):
        assert len(assert_exact(run, f"c{i}")) == 6
    assert run["leak_free_concurrent"]


def test_long_prompts_are_chunked_on_each_rank_at_once(run):
    assert {run["ranks"]["long0"], run["ranks"]["long1"]} == {0, 1}
    steps = steps_of(run, "chunked")
    assert any(s["mode"] == "EXTEND" and s["tokens"] == [CHUNK, CHUNK] for s in steps), steps
    assert_exact(run, "long0")
    assert_exact(run, "long1")


def test_a_rank_left_idle(run):
    rank = run["ranks"]["alone"]
    steps = steps_of(run, "idle")
    assert steps and all(s["rows"][1 - rank] == 0 and s["rows"][rank] == 1 for s in steps)
    assert len(assert_exact(run, "alone")) == 5


def test_abort_mid_generation(run):
    assert run["ranks"]["keep"] != run["ranks"]["abort"]
    out = assert_exact(run, "abort", finish="abort")
    assert 0 < len(out) < 30
    assert len(assert_exact(run, "keep")) == 8


def test_prefix_hit_on_the_rank_that_caches_it(run):
    assert run["ranks"]["again"] == run["ranks"]["first"]
    assert run["records"]["first"]["cached_tokens"] == 0
    assert run["records"]["again"]["cached_tokens"] == 20  # 21 - 1 tokens, whole pages of 4
    assert assert_exact(run, "again") == assert_exact(run, "first")


def test_retraction_within_each_rank(run):
    assert run["retractions"] >= 2
    retracted = run["retracted"]
    assert {rank for _, rank, _ in retracted} == {0, 1}
    assert all(run["ranks"][rid] == rank for rid, rank, _ in retracted)
    # A resumed request re-prefilled in chunks holds KV too: it is retracted (the newest)
    # rather than the older request of its rank being aborted as if it were alone.
    assert any(part_way for _, _, part_way in retracted)
    assert sorted(run["ranks"][f"r{i}"] for i in range(4)) == [0, 0, 1, 1]
    for i in range(4):
        assert len(assert_exact(run, f"r{i}")) == 30


def test_a_request_too_long_for_its_rank_is_aborted_alone(run):
    assert run["ranks"]["huge"] != run["ranks"]["small"]
    reason = run["records"]["huge"]["finished_reason"]
    assert "out of KV cache" in reason["message"] and "per DP attention rank" in reason["message"]
    out = assert_exact(run, "huge", finish="abort")
    assert 30 + len(out) >= 48 - 4  # it grew to (about) its rank's whole KV cache
    assert len(assert_exact(run, "small")) == 4


def test_shortest_queue(run):
    assert [run["ranks"][f"q{i}"] for i in range(3)] == [0, 1, 0]
    for i in range(3):
        assert_exact(run, f"q{i}")


def test_minimum_tokens(run):
    assert [run["ranks"][f"m{i}"] for i in range(3)] == [0, 1, 1]
    for i in range(3):
        assert_exact(run, f"m{i}")


def test_server_info_per_rank_and_no_leak(run):
    assert run["leak_free"]
    info = run["server_info"]
    assert info["dp_size"] == 2 and info["total_kv_slots"] == 96
    assert [r["total_kv_slots"] for r in info["dp_ranks"]] == [48, 48]
    assert all(r["num_running_reqs"] == r["num_waiting_reqs"] == 0 for r in info["dp_ranks"])
    assert info["num_retractions"] >= 2


def test_engine_serves_concurrent_requests_on_both_ranks(engine_run):
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH)
    layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    for ids, out in zip(engine_run["prompts"], engine_run["outs"], strict=True):
        n = out["meta_info"]["completion_tokens"]
        assert out["output_ids"] == reference_greedy(ids, n)
        np.testing.assert_array_equal(decoded_rows(out, layers, k),
                                      expected_rows(ids, out["output_ids"]))
    again = engine_run["again"]
    assert again["output_ids"] == engine_run["outs"][5]["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0
    np.testing.assert_array_equal(decoded_rows(again, layers, k),
                                  decoded_rows(engine_run["outs"][5], layers, k))
    info = engine_run["server_info"]
    assert info["dp_size"] == 2 and len(info["dp_ranks"]) == 2
    # Both ranks served (their trees cache what their requests computed) and nothing leaked.
    assert all(r["evictable_kv_slots"] > 0 for r in info["dp_ranks"]), info["dp_ranks"]
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    assert info["locked_kv_slots"] == 0
    assert info["available_kv_slots"] + info["evictable_kv_slots"] == info["total_kv_slots"]
    assert info["free_req_slots"] == info["total_req_slots"]
