"""The other features with data-parallel attention (M19 item 3): dp2 on a tp2 x ep2 layout of
4 fake CPU devices, requests on both ranks at once, every output against the float64
reference (tokens, routed-experts rows, routing weights, logprobs) or against itself
(determinism).

tests/dp_features_worker.py runs the engines in subprocesses (the mesh must be fixed before JAX
starts), one per layout:

- ``multi``: deterministic inference with routed experts, their weights, logprobs (input and
  top too) and the stat recorder; scoring; ``update_weights_from_disk`` and
  ``update_weights_from_tensor``, also while a request runs on each rank (with and without
  ``abort_all_requests``);
- ``single``: single-process mode on a caller's mesh with the per_token recorder,
  ``update_weights_from_arrays`` with JAX arrays, release and resume of memory;
- ``eplb``: EPLB rebalancing, streamed routed experts, pause and continue;
- ``mla``: DeepSeek-V3's tiny preset (latent cache split over the ranks).

A multi-node job (two processes on loopback, ep across them: one DP rank per node) serves
concurrent requests, releases and resumes memory and takes a weight update, here directly.
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
from sgl_jax.srt.routed_experts_codec import (
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.testing import TEST_MODEL_PATH, MultiNodeJob, fake_devices_flags, server_flags
from sgl_jax.tools.make_random_model import write_random_model
from tests.dp_features_worker import (
    INPUT_LP_PROMPTS,
    MAX_NEW,
    PROMPTS,
    RIDS,
    RUNNING_NEW,
    SCORE_COMPLETIONS,
    SCORE_PROMPT,
    TARGET,
    TARGET_NEW,
)
from tests.engine_utils import (
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference,
    reference_greedy,
)

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
REPO = Path(__file__).absolute().parents[1]
# Float32 engine against the float64 reference (tests/test_logprobs.py's tolerance).
LOGPROB_TOL, LOGPROB_RTOL = 1e-5, 4e-6


def _worker(mode: str, second: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pkl")
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(4)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.dp_features_worker", mode, second, path],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(path, "rb") as f:
            return pickle.load(f)


@pytest.fixture(scope="module")
def multi(second_ckpt) -> dict[str, Any]:
    return _worker("multi", second_ckpt)


@pytest.fixture(scope="module")
def single(second_ckpt) -> dict[str, Any]:
    return _worker("single", second_ckpt)


def check_against_reference(prompts: list[list[int]], max_new: list[int], outs: list[dict],
                            path: str = TEST_MODEL_PATH) -> None:
    cfg = ModelConfig.from_hf(path)
    for ids, n, out in zip(prompts, max_new, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, n, path)
        np.testing.assert_array_equal(
            decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok),
            expected_rows(ids, out["output_ids"], path))


def both_ranks_served(info: dict) -> bool:
    """Each rank's radix tree caches what its requests computed (nothing was flushed since)."""
    return len(info["dp_ranks"]) == 2 and all(r["evictable_kv_slots"] > 0
                                              for r in info["dp_ranks"])


def no_leak(info: dict) -> bool:
    return (info["num_running_reqs"] == info["num_waiting_reqs"] == 0
            and info["locked_kv_slots"] == 0
            and info["available_kv_slots"] + info["evictable_kv_slots"] == info["total_kv_slots"])


# -- single-process mode --------------------------------------------------------------------------
def test_single_process_on_a_callers_mesh(single):
    assert single["child_pids"] == {}  # the scheduler is a thread of the worker
    check_against_reference(PROMPTS, MAX_NEW, single["outs"])
    assert both_ranks_served(single["server_info"]) and no_leak(single["server_info"])


def test_per_token_recorder_rows_rids_and_positions(single):
    """The per_token recorder with DP: every real token once (no rank's padding), under its
    request's id and position, with the reference's routed ids."""
    rec = single["per_token"]
    assert len(rec["rid"]) == sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_NEW, strict=True))
    for rid, ids, out in zip(RIDS, PROMPTS, single["outs"], strict=True):
        mine = rec["rid"] == rid
        order = np.argsort(rec["position"][mine], kind="stable")
        want = expected_rows(ids, out["output_ids"])
        assert rec["position"][mine][order].tolist() == list(range(len(want)))
        np.testing.assert_array_equal(rec["topk_ids"][mine][order], want)


def test_single_process_update_from_jax_arrays(single, second_ckpt):
    assert single["update"] == {"success": True, "host_bytes": 1, "weight_version": "second"}
    assert all(o["meta_info"]["weight_version"] == "second" for o in single["after_update"])
    check_against_reference(PROMPTS, MAX_NEW, single["after_update"], second_ckpt)
    before, after = single["compiles"]
    assert after == before  # the same shapes: nothing recompiled


def test_release_and_resume_memory(single):
    """Each rank's KV shard and the weights freed and put back: the outputs are what they
    were (the caches were emptied: computed again), with no step recompiled."""
    assert single["release"]["released"] == ["kv_cache", "weights"]
    assert single["release"]["device_bytes_after"] < single["release"]["device_bytes_before"]
    assert single["resume"]["released"] == []
    for out, before in zip(single["after_resume"], single["after_update"], strict=True):
        assert out["output_ids"] == before["output_ids"]
        assert out["meta_info"]["routed_experts"] == before["meta_info"]["routed_experts"]


# -- multi-process: routing weights, logprobs, recorder, determinism, weight update --------------
def check_output_logprobs(outs: list[dict], path: str = TEST_MODEL_PATH) -> None:
    for ids, out in zip(PROMPTS, outs, strict=True):
        seq = ids + out["output_ids"]
        lp = ref_logprobs(seq[:-1], path)[len(ids) - 1:]
        got = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got] == out["output_ids"]
        want = lp[np.arange(len(got)), out["output_ids"]]
        np.testing.assert_allclose([v for v, _, _ in got], want, atol=LOGPROB_TOL,
                                   rtol=LOGPROB_RTOL)


def check_routing_weights(outs: list[dict], path: str = TEST_MODEL_PATH) -> None:
    """The router's top-k weights of every row (0 on dense layers) within float32 rounding
    (tests/test_routed_experts.py's tolerance)."""
    for ids, out in zip(PROMPTS, outs, strict=True):
        weights = extract_routed_expert_weights_from_meta_info(out)
        assert weights.dtype == np.float32
        ref = reference(path).forward(ids + out["output_ids"][:-1])
        assert weights.shape == ref.topk_weights.shape
        np.testing.assert_allclose(weights, ref.topk_weights, rtol=1e-5, atol=1e-6)


def check_recorder_counts(load: dict, outs: list[dict], path: str = TEST_MODEL_PATH) -> None:
    cfg = ModelConfig.from_hf(path)
    rows = np.concatenate([expected_rows(ids, out["output_ids"], path)
                           for ids, out in zip(PROMPTS, outs, strict=True)])
    assert load["moe_layers"] == list(cfg.moe_layer_ids)
    # Every forwarded token once: no rank's padding, no token counted on both ranks.
    assert load["num_tokens"] == len(rows) == sum(len(p) + n - 1
                                                   for p, n in zip(PROMPTS, MAX_NEW, strict=True))
    want = np.stack([np.bincount(rows[:, layer].ravel(), minlength=cfg.num_experts)
                     for layer in load["moe_layers"]])
    np.testing.assert_array_equal(np.array(load["counts"]), want)


def test_tokens_rows_and_logprobs_equal_the_reference(multi):
    check_against_reference(PROMPTS, MAX_NEW, multi["outs"])
    assert both_ranks_served(multi["info_after_batch"])
    check_output_logprobs(multi["outs"])


def test_mixed_batch_rows_of_the_askers_only(multi):
    """Two requests of four (one per rank) ask for routed experts: theirs equal the
    reference, the others carry none (the rows are put in the scheduler's order on the
    host, and only the askers' are copied)."""
    asked = [True, False, False, True]
    outs = multi["mixed"]
    check_against_reference([p for p, a in zip(PROMPTS, asked, strict=True) if a],
                            [n for n, a in zip(MAX_NEW, asked, strict=True) if a],
                            [o for o, a in zip(outs, asked, strict=True) if a])
    for out, a in zip(outs, asked, strict=True):
        if not a:
            assert extract_routed_experts_from_meta_info(out) is None


def ref_logprobs(ids: list[int], path: str = TEST_MODEL_PATH) -> np.ndarray:
    """[len(ids), V] float64: row p is the distribution of the token after position p."""
    logits = reference(path).forward(ids).logits
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def test_input_logprobs_and_top_logprobs_on_both_ranks(multi):
    for ids, out in zip(INPUT_LP_PROMPTS, multi["input_lp"], strict=True):
        meta = out["meta_info"]
        seq = ids + out["output_ids"]
        lp = ref_logprobs(seq[:-1])
        # Prompt position p > 0: the logprob of token p given tokens < p (row p - 1); then
        # the generated tokens.
        got = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
        tops = meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]
        assert [t for _, t, _ in got] == seq[1:]
        np.testing.assert_allclose([v for v, _, _ in got], lp[np.arange(len(got)), seq[1:]],
                                   atol=LOGPROB_TOL, rtol=LOGPROB_RTOL)
        for row, top in enumerate(tops):
            want = np.argsort(-lp[row], kind="stable")[:3]
            assert [t for _, t, _ in top] == want.tolist()
            np.testing.assert_allclose([v for v, _, _ in top], lp[row, want],
                                       atol=LOGPROB_TOL, rtol=LOGPROB_RTOL)


def test_score_a_shared_prompt(multi):
    """Engine.score: the completions' logprobs (temperature 0.7) and routed-experts rows."""
    records = multi["score"]
    assert len(records) == len(SCORE_COMPLETIONS)
    for rec, completion in zip(records, SCORE_COMPLETIONS, strict=True):
        seq = SCORE_PROMPT + completion
        logits = reference().forward(seq[:-1]).logits[len(SCORE_PROMPT) - 1:] / 0.7
        shifted = logits - logits.max(axis=1, keepdims=True)
        lp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        np.testing.assert_allclose(rec["logprobs"], lp[np.arange(len(completion)), completion],
                                   atol=LOGPROB_TOL, rtol=LOGPROB_RTOL)
        np.testing.assert_array_equal(rec["routed_experts"],
                                      expected_rows(SCORE_PROMPT, completion))
    # The prompt was prefilled once and every completion went to the rank caching it
    # (prefix affinity): each took it from that rank's cache up to its first scored position.
    assert [r["cached_tokens"] for r in records] == [len(SCORE_PROMPT) - 1] * len(records)
    assert [r["evictable_kv_slots"] > 0 for r in multi["score_info"]["dp_ranks"]].count(True) == 1
    assert no_leak(multi["score_info"])


def test_routing_weights_equal_the_reference(multi):
    check_routing_weights(multi["outs"])


def test_recorder_counts_equal_the_reference_rows(multi):
    check_recorder_counts(multi["load"], multi["outs"])


def _key(out: dict) -> tuple:
    lps = np.array([e[0] for e in out["meta_info"]["output_token_logprobs"]], np.float64)
    return (tuple(out["output_ids"]), lps.tobytes(),
            extract_routed_experts_from_meta_info(out).tobytes())


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_deterministic_alone_and_in_batches_on_either_rank(multi, sampling):
    """The target alone on one rank, alone on the other, and inside batches whose mates load
    its rank and the other one differently: bitwise the same ids, logprobs and rows (greedy,
    and seeded sampling). Without the flag the logprobs differ in the last bits here."""
    det = multi["det"][sampling]
    alone = det["alone"]
    greedy = reference_greedy(TARGET, TARGET_NEW)
    assert (alone["output_ids"] == greedy) == (sampling == "greedy")  # seeded: really sampled
    np.testing.assert_array_equal(decoded_rows(alone, L, K),
                                  expected_rows(TARGET, alone["output_ids"]))
    # Round robin: the two lone runs went to different ranks (each rank's tree shows it).
    assert sorted(det["alone_ranks"]) == [[0], [1]], det["alone_ranks"]
    want = _key(alone)
    assert _key(det["alone_other_rank"]) == want
    for i, out in enumerate(det["batched"]):
        assert _key(out) == want, f"batch {i}"


def test_update_weights_from_disk_then_from_tensor(multi, second_ckpt):
    update = multi["update"]
    assert update["success"] and update["weight_version"] == "1"
    assert all(o["meta_info"]["weight_version"] == "1" for o in multi["after_update"])
    check_against_reference(PROMPTS, MAX_NEW, multi["after_update"], second_ckpt)
    # update_weights_from_tensor (host arrays to a scheduler process) back to the first.
    assert multi["update_back"]["success"]
    assert all(o["meta_info"]["weight_version"] == "back" for o in multi["after_update_back"])
    check_against_reference(PROMPTS, MAX_NEW, multi["after_update_back"])
    assert no_leak(multi["server_info"])


def test_weight_updates_while_a_request_runs_on_each_rank(multi, second_ckpt):
    """Without abort_all_requests the running requests finish on the old weights (all their
    tokens the first checkpoint's), then the update applies; with it they are aborted, their
    tokens so far the second checkpoint's, and the first serves again."""
    assert multi["running_per_rank"] == [[1, 1], [1, 1]]
    assert multi["update_running"]["success"]
    check_against_reference(PROMPTS[:2], [RUNNING_NEW] * 2, multi["running"])
    assert all(o["meta_info"]["weight_version"] == "back" for o in multi["running"])
    check_against_reference(PROMPTS[:2], MAX_NEW[:2], multi["after_running"], second_ckpt)
    assert multi["update_abort"]["success"]
    for ids, out in zip(PROMPTS[:2], multi["aborted"], strict=True):
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        n = len(out["output_ids"])
        assert 0 < n < 300 and out["output_ids"] == reference_greedy(ids, n, second_ckpt)
    check_against_reference(PROMPTS[:2], MAX_NEW[:2], multi["after_abort"])


# -- EPLB and streaming ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eplb(second_ckpt) -> dict[str, Any]:
    return _worker("eplb", second_ckpt)


def test_eplb_rebalance_keeps_outputs_exact(eplb):
    check_against_reference(PROMPTS, MAX_NEW, eplb["before"])
    table = eplb["rebalance"]["physical_to_logical"]
    assert len(table) == len(CFG.moe_layer_ids)
    assert all(len(row) == CFG.num_experts + 2 for row in table)
    assert all(a <= b for a, b in zip(eplb["rebalance"]["imbalance_after"],
                                      eplb["rebalance"]["imbalance_before"], strict=True))
    check_against_reference(PROMPTS, MAX_NEW, eplb["after"])
    before, after = eplb["compiles"]
    assert after == before


def test_streamed_routed_experts_on_both_ranks(eplb):
    for ids, n, chunks in zip(PROMPTS[:2], MAX_NEW[:2], eplb["streamed"], strict=True):
        assert len(chunks) == n  # one chunk per generated token
        out = sum((c["output_ids"] for c in chunks), [])
        assert out == reference_greedy(ids, n)
        starts = [c["meta_info"]["routed_experts_start"] for c in chunks]
        parts = [extract_routed_experts_from_meta_info(c).reshape(-1, L, K) for c in chunks]
        assert starts == np.cumsum([0] + [len(p) for p in parts[:-1]]).tolist()
        np.testing.assert_array_equal(np.concatenate(parts), expected_rows(ids, out))
    assert both_ranks_served(eplb["stream_info"]) and no_leak(eplb["stream_info"])


def test_pause_and_continue_with_a_request_on_each_rank(eplb):
    assert eplb["paused_per_rank"] == [1, 1]
    assert eplb["paused_info"]["paused"]
    # Paused: no step ran (each rank's KV held, no request finished).
    assert eplb["paused_info_later"]["dp_ranks"] == eplb["paused_info"]["dp_ranks"]
    assert eplb["paused_info_later"]["num_running_reqs"] == 2
    check_against_reference(PROMPTS[:2], [RUNNING_NEW] * 2, eplb["paused"])
    assert no_leak(eplb["server_info"])


# -- DeepSeek-V3's MLA -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ds") / "tiny-deepseek-v3"
    write_random_model(str(path), "tiny-deepseek-v3", seed=3)
    return str(path)


def test_mla_rows_weights_logprobs_and_recorder(deepseek_path):
    """The latent cache split over the ranks, a dense first layer (rows -1, weights 0)."""
    mla = _worker("mla", deepseek_path)
    assert not all(ModelConfig.from_hf(deepseek_path).moe_layers)
    check_against_reference(PROMPTS, MAX_NEW, mla["outs"], deepseek_path)
    check_output_logprobs(mla["outs"], deepseek_path)
    check_routing_weights(mla["outs"], deepseek_path)
    check_recorder_counts(mla["load"], mla["outs"], deepseek_path)
    assert both_ranks_served(mla["server_info"]) and no_leak(mla["server_info"])


# -- multi-node: one DP rank per node ---------------------------------------------------------------
MN_PROMPTS = [prompt_ids(1300 + i, n) for i, n in enumerate([9, 40, 17, 5])]
MN_NEW = 6


def test_multi_node_one_rank_per_node(second_ckpt):
    """Two nodes of 2 devices (tp 2 within a node, ep 2 across): each node is a DP rank.
    Concurrent requests, a release and resume, and a weight update reach both."""
    flags = server_flags(tp_size=2, ep_size=2, enable_dp_attention=True, dp_size=2,
                         enable_return_routed_experts=True, chunked_prefill_size=32,
                         precompile_token_paddings=[32], precompile_bs_paddings=[1, 2, 4],
                         page_size=4, disable_precompile=True)
    job = MultiNodeJob(flags)
    try:
        def generate() -> list[dict]:
            res = job.leader.post("/generate", json={
                "input_ids": MN_PROMPTS, "return_routed_experts": True,
                "sampling_params": {"temperature": 0.0, "ignore_eos": True,
                                    "max_new_tokens": MN_NEW}})
            assert res.status_code == 200, res.text
            return res.json()

        first = generate()
        check_against_reference(MN_PROMPTS, [MN_NEW] * len(MN_PROMPTS), first)
        info = job.leader.get("/get_server_info").json()
        assert both_ranks_served(info) and no_leak(info)
        # Released and resumed on both nodes (each its rank's KV shard): the same outputs.
        res = job.leader.post("/release_memory_occupation", json={})
        assert res.status_code == 200 and res.json()["released"] == ["kv_cache", "weights"]
        res = job.leader.post("/resume_memory_occupation", json={})
        assert res.status_code == 200 and res.json()["released"] == [], res.text
        assert [o["output_ids"] for o in generate()] == [o["output_ids"] for o in first]
        # New weights on both nodes: the second checkpoint's reference on both ranks.
        res = job.leader.post("/update_weights_from_disk", json={"model_path": second_ckpt})
        assert res.status_code == 200 and res.json()["success"], res.text
        check_against_reference(MN_PROMPTS, [MN_NEW] * len(MN_PROMPTS), generate(),
                                second_ckpt)
        assert no_leak(job.leader.get("/get_server_info").json())
        assert "diverge" not in job.follower_log()
        code, follower_codes = job.stop()
        assert code == 0 and follower_codes == [0], job.follower_log()
    finally:
        job.kill()
