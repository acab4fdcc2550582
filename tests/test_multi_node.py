"""One engine across two processes on loopback: the multi-node job of docs/parallelism.md.

Two ``launch_server`` processes (``--nnodes 2``), each with 2 fake CPU devices, form one JAX
job (``jax.distributed``, gloo collectives) with tp 2 within a process and ep 2 across them.
Node 0 serves HTTP; node 1 runs node 0's steps. Greedy tokens and routed experts must equal
the float64 reference and a single-process run of the same layout on 4 devices, alone, on a
cached prefix and with chunked prefill; a node that dies or stops makes node 0 fail fast; a
SIGTERM to node 0 stops both; a node with other flags fails at start-up saying what differs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests
from safetensors.numpy import load_file, save_file

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.utils import free_port
from sgl_jax.testing import (
    TEST_MODEL_PATH,
    MultiNodeJob,
    ServerProcess,
    fake_devices_flags,
    server_flags,
    wait_until,
)
from tests.engine_utils import decoded_rows, expected_rows, prompt_ids, reference_greedy

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": NEW_TOKENS}
LAYOUT = server_flags(
    tp_size=2, ep_size=2, enable_return_routed_experts=True, chunked_prefill_size=32,
    precompile_token_paddings=[32], precompile_bs_paddings=[1, 2, 4], page_size=4,
)
# What is asked of both runs: alone; on a cached prefix (a's first 20 tokens); a prompt of 80
# tokens prefilled in chunks of 32; two prompts in one call (decoded together).
A = prompt_ids(11, 24)
PROMPTS = {
    "alone": [A],
    "cached_prefix": [A[:20] + prompt_ids(12, 10)],
    "chunked": [prompt_ids(13, 80)],
    "batch": [prompt_ids(14, 9), prompt_ids(15, 17)],
}


def generate(server: ServerProcess, ids: list[list[int]]) -> list[dict]:
    res = server.post("/generate", json={
        "input_ids": ids, "sampling_params": GREEDY, "return_routed_experts": True})
    assert res.status_code == 200, res.text
    return res.json()


def run_all(server: ServerProcess) -> dict[str, list[dict]]:
    return {name: generate(server, ids) for name, ids in PROMPTS.items()}


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def single_process() -> dict[str, list[dict]]:
    """The same layout in one process on 4 devices."""
    server = ServerProcess(LAYOUT, env={
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": fake_devices_flags(4)})
    try:
        return run_all(server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def two_nodes():
    job = MultiNodeJob(LAYOUT)
    try:
        yield job
    finally:
        job.kill()


@pytest.fixture(scope="module")
def two_node_results(two_nodes) -> dict[str, list[dict]]:
    return run_all(two_nodes.leader)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_tokens_and_routed_experts_equal_reference(two_node_results, name):
    for ids, out in zip(PROMPTS[name], two_node_results[name], strict=True):
        assert out["output_ids"] == reference_greedy(ids, NEW_TOKENS)
        rows = decoded_rows(out, CFG.num_hidden_layers, CFG.num_experts_per_tok)
        assert rows.shape[0] == len(ids) + NEW_TOKENS - 1
        assert (rows.min(), rows.max()) >= (0, 0) and rows.max() < CFG.num_experts
        assert (rows == expected_rows(ids, out["output_ids"])).all()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_equal_to_single_process(two_node_results, single_process, name):
    for multi, single in zip(two_node_results[name], single_process[name], strict=True):
        assert multi["output_ids"] == single["output_ids"]
        assert multi["meta_info"]["routed_experts"] == single["meta_info"]["routed_experts"]
        assert multi["meta_info"]["cached_tokens"] == single["meta_info"]["cached_tokens"]


def test_the_prefix_cache_was_used(two_node_results):
    assert two_node_results["cached_prefix"][0]["meta_info"]["cached_tokens"] >= 16


def test_release_and_resume_reach_every_node(two_nodes, two_node_results):
    """/release_memory_occupation frees the KV cache and the weights on both nodes (each its
    own shards) and /resume_memory_occupation restores them: the outputs are then what they
    were, with no step recompiled."""
    server = two_nodes.leader
    compiles = server.get("/get_server_info").json()["num_compiles"]
    res = server.post("/release_memory_occupation", json={})
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["released"] == ["kv_cache", "weights"]
    assert out["device_bytes_after"] < out["device_bytes_before"]
    res = server.post("/generate", json={"input_ids": A, "sampling_params": GREEDY})
    assert res.status_code == 503 and res.json()["error"]["code"] == "memory_released"
    res = server.post("/resume_memory_occupation", json={})
    assert res.status_code == 200 and res.json()["released"] == [], res.text
    for name, outs in run_all(server).items():
        for out, before in zip(outs, two_node_results[name], strict=True):
            assert out["output_ids"] == before["output_ids"]
            assert out["meta_info"]["routed_experts"] == before["meta_info"]["routed_experts"]
    assert server.get("/get_server_info").json()["num_compiles"] == compiles
    assert wait_until(lambda: "resumed kv_cache, weights" in two_nodes.follower_log(), timeout=10)
    assert "released kv_cache, weights: live device bytes" in two_nodes.follower_log()
    assert "diverge" not in two_nodes.follower_log()


def test_weight_update_reaches_every_node(two_nodes, two_node_results, second_ckpt, tmp_path):
    """/update_weights_from_disk on node 0 replaces the weights on both nodes: the outputs
    then equal the reference of the new checkpoint (a node left on the old weights would
    change every cross-node all-reduce)."""
    server = two_nodes.leader
    res = server.post("/update_weights_from_disk", json={"model_path": second_ckpt})
    assert res.status_code == 200 and res.json()["success"], res.text
    ids = PROMPTS["alone"][0]
    (out,) = generate(server, [ids])
    assert out["meta_info"]["weight_version"] == "1"
    assert out["output_ids"] == reference_greedy(ids, NEW_TOKENS, path=second_ckpt)
    rows = decoded_rows(out, CFG.num_hidden_layers, CFG.num_experts_per_tok)
    assert (rows == expected_rows(ids, out["output_ids"], path=second_ckpt)).all()
    # An update that fails while loading (a config that matches, no weights) fails alike on
    # both nodes (the same outcome): the job goes on serving on the weights it had.
    shutil.copy(os.path.join(second_ckpt, "config.json"), tmp_path)
    res = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert res.status_code == 400 and "no *.safetensors" in res.text, res.text
    assert generate(server, [ids])[0]["output_ids"] == out["output_ids"]
    # A NaN in an expert only node 1 holds (ep 2 across the nodes: experts 8-15 there): each
    # node reads and checks only its own experts, so node 0 finds nothing wrong, yet both
    # refuse: the nodes agree on the outcome before swapping (weight_updater), and node 0's
    # answer says which node found what.
    nan_dir = tmp_path / "nan_on_node_1"
    nan_dir.mkdir()
    shutil.copy(os.path.join(second_ckpt, "config.json"), nan_dir)
    tensors = load_file(os.path.join(second_ckpt, "model.safetensors"))
    bad = "model.layers.1.mlp.experts.12.down_proj.weight"
    tensors[bad][0, 0] = np.nan
    save_file(tensors, str(nan_dir / "model.safetensors"))
    res = server.post("/update_weights_from_disk", json={"model_path": str(nan_dir)})
    assert res.status_code == 400, res.text
    assert f"node 1 of the job: {nan_dir}: tensor '{bad}' has non-finite" in res.text, res.text
    assert generate(server, [ids])[0]["output_ids"] == out["output_ids"]
    assert "diverge" not in two_nodes.follower_log()


def test_sigterm_on_node_0_stops_every_process(two_nodes, two_node_results):
    pids = two_nodes.leader.get("/get_server_info").json()["pids"]
    code, follower_codes = two_nodes.stop()
    assert code == 0
    assert follower_codes == [0], two_nodes.follower_log()
    assert "rank 0 stopped the job" in two_nodes.follower_log()
    assert wait_until(lambda: all(gone(p) for p in pids.values()), timeout=10), pids


FAULT_FLAGS = server_flags(tp_size=2, ep_size=2, disable_precompile=True, dist_timeout=3)


def test_follower_death_fails_node_0_fast():
    job = MultiNodeJob(FAULT_FLAGS)
    try:
        out: dict[str, object] = {}

        def long_request() -> None:
            try:
                out["res"] = job.leader.post("/generate", timeout=60, json={
                    "text": "a long one", "sampling_params": {"max_new_tokens": 400,
                                                              "ignore_eos": True}})
            except requests.RequestException as e:
                out["res"] = e

        thread = threading.Thread(target=long_request)
        thread.start()
        assert wait_until(lambda: job.leader.get("/get_server_info").json()[
            "num_generated_tokens"] > 0, timeout=60)
        job.followers[0].kill()
        t0 = time.monotonic()
        thread.join(30)
        assert job.leader.proc.wait(30) == 1
        assert time.monotonic() - t0 < 10
        res = out["res"]
        assert isinstance(res, requests.Response) and res.status_code == 503, res
        assert "lost the connection to node 1" in job.leader.log()
    finally:
        job.kill()


def test_stopped_follower_fails_node_0_within_dist_timeout():
    job = MultiNodeJob(FAULT_FLAGS)
    follower = job.followers[0]
    try:
        follower.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert job.leader.proc.wait(30) == 1
        assert 3 <= time.monotonic() - t0 < 15
        assert "node 1 sent nothing for 3 s" in job.leader.log()
        follower.send_signal(signal.SIGCONT)  # it finds node 0 gone and stops
        assert follower.wait(30) == 1
        assert "lost the connection to rank 0" in job.follower_log() or \
            "rank 0 sent nothing" in job.follower_log()
    finally:
        follower.send_signal(signal.SIGCONT)
        job.kill()


def test_mismatched_follower_fails_at_start_up_saying_what_differs():
    job = MultiNodeJob(FAULT_FLAGS, wait=False,
                       follower_args=server_flags(tp_size=2, ep_size=2, disable_precompile=True,
                                                  dist_timeout=3, chunked_prefill_size=128))
    leader = subprocess.run(
        [sys.executable, "-m", "sgl_jax.launch_server", "--port", str(free_port()),
         *job.leader_args],
        env={**os.environ, **job.env}, capture_output=True, text=True, timeout=120)
    try:
        assert job.followers[0].wait(60) == 1
    finally:
        job.kill()
    difference = "--chunked-prefill-size: node 0 has 256, this node 128"
    assert leader.returncode == 1
    assert difference in leader.stdout + leader.stderr
    assert difference in job.follower_log()


def test_engine_refuses_a_follower_rank():
    from sgl_jax import Engine

    with pytest.raises(ValueError, match="only node 0 runs an Engine"):
        Engine(nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1234")
