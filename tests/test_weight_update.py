"""New weights without a restart, and pause / continue (M10 items 2-3).

A server on the test checkpoint (``TEST_MODEL_PATH``) is updated from a second checkpoint of the same shapes
(``make_random_model`` with another seed). After the update its outputs must equal a fresh
Engine started on the second checkpoint, token for token and row for row, and its routed
experts the independent float64 reference of the second checkpoint; nothing is recompiled and
the prefix cache starts empty. Bad sources are 400s / ValueErrors naming what differs, and the
server keeps serving on the old weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags, wait_until
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows
from tests.server_utils import server_fixture

PROMPTS = [[5, 17, 99, 3, 250, 41, 8], list(range(30, 90))]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}
BASE = TEST_MODEL_PATH  # the checkpoint the server starts on


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags(enable_return_routed_experts=True))


@pytest.fixture(scope="module")
def fresh(second_ckpt):
    """A fresh Engine started on the second checkpoint: what an update must reproduce."""
    eng = Engine(**engine_args(model_path=second_ckpt, enable_return_routed_experts=True))
    yield eng
    eng.shutdown()


def generate(server, ids: list[list[int]], **params) -> list[dict]:
    res = server.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, **params},
                                         "return_routed_experts": True})
    assert res.status_code == 200, res.text
    return res.json()


def info(server) -> dict:
    return server.get("/get_server_info").json()


def update(server, path: str, **body) -> dict:
    res = server.post("/update_weights_from_disk", json={"model_path": path, **body})
    return res.status_code, res.json()


def test_update_from_disk_equals_a_fresh_engine(server, fresh, second_ckpt):
    before = generate(server, PROMPTS)
    assert all(r["meta_info"]["weight_version"] == "0" for r in before)
    compiles = info(server)["num_compiles"]
    status, out = update(server, second_ckpt)
    assert status == 200, out
    assert out["success"] and out["weight_version"] == "1" and out["num_parameters"] > 0
    after = generate(server, PROMPTS)
    want = fresh.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_routed_experts=True)
    ref = ReferenceModel(second_ckpt)
    for got, exp, prompt in zip(after, want, PROMPTS, strict=True):
        assert got["output_ids"] == exp["output_ids"]
        assert got["meta_info"]["weight_version"] == "1"
        assert got["meta_info"]["cached_tokens"] == 0  # the old weights' cache was flushed
        rows = extract_routed_experts_from_meta_info(got)
        np.testing.assert_array_equal(rows, extract_routed_experts_from_meta_info(exp))
        np.testing.assert_array_equal(rows, routed_experts_rows(ref, prompt, got["output_ids"]))
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(before, after, strict=True))
    assert info(server)["num_compiles"] == compiles  # parameters swapped, steps reused
    assert info(server)["weight_version"] == "1"
    # Back to the first weights, with a caller's version string.
    status, out = update(server, BASE, weight_version="step-7", load_format="safetensors")
    assert status == 200 and out["weight_version"] == "step-7"
    again = generate(server, PROMPTS)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in before]
    assert again[0]["meta_info"]["weight_version"] == "step-7"


@pytest.mark.parametrize("make,needle", [
    (lambda p: write_random_model(p, "tiny", {"hidden_size": 32}, seed=2), r"hidden_size 64 -> 32"),
    (lambda p: write_random_model(p, "tiny", {"num_experts": 8}, seed=2), r"num_experts 16 -> 8"),
    (lambda p: None, r"no config\.json"),
])
def test_update_from_another_shape_is_a_400_naming_it(server, tmp_path, make, needle):
    make(str(tmp_path))
    before = generate(server, PROMPTS[:1])
    status, out = update(server, str(tmp_path))
    assert status == 400
    assert out["error"]["param"] == "model_path"
    assert re.search(needle, out["error"]["message"]), out
    after = generate(server, PROMPTS[:1])
    assert after[0]["output_ids"] == before[0]["output_ids"]  # still the same weights
    assert update(server, BASE, load_format="pt")[0] == 400  # only safetensors is read


def test_running_requests_finish_on_the_old_weights_or_are_aborted(server, second_ckpt):
    results: dict[str, dict] = {}

    def long_request(name: str) -> threading.Thread:
        def run() -> None:
            res = server.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {
                "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}})
            results[name] = res.json()
        thread = threading.Thread(target=run)
        thread.start()
        assert wait_until(lambda: info(server)["num_running_reqs"] == 1, timeout=30,
                          interval=0.01)
        return thread

    version = info(server)["weight_version"]
    thread = long_request("drained")
    status, out = update(server, second_ckpt)  # waits for the running request
    thread.join(30)
    assert status == 200
    drained = results["drained"]["meta_info"]
    assert drained["finish_reason"]["type"] == "length"
    assert drained["weight_version"] == version and out["weight_version"] != version

    thread = long_request("aborted")
    status, out = update(server, BASE, abort_all_requests=True)
    thread.join(30)
    assert status == 200
    aborted = results["aborted"]["meta_info"]
    assert aborted["finish_reason"] == {"type": "abort",
                                        "message": "aborted for a weight update"}
    assert info(server)["num_running_reqs"] == 0


def test_two_concurrent_updates_each_get_their_own_answer(server, second_ckpt):
    """While an update waits for a running request, a second one is refused at once: each
    caller gets the answer to its own update (replies pair with calls by id, not by order)."""
    done: dict[str, tuple] = {}
    body = {"input_ids": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}}
    request = threading.Thread(target=lambda: server.post("/generate", json=body))
    request.start()
    assert wait_until(lambda: info(server)["num_running_reqs"] == 1, timeout=30,
                      interval=0.01)
    threads = [threading.Thread(target=lambda v=v: done.update({v: update(
        server, second_ckpt, weight_version=v)})) for v in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads + [request]:
        thread.join(60)
    (ok, (_, out)), = [(v, r) for v, r in done.items() if r[0] == 200]
    assert out["weight_version"] == ok  # the update this caller asked for
    (_, (status, refused)), = [(v, r) for v, r in done.items() if v != ok]
    assert status == 400 and "another weight update is in progress" in \
        refused["error"]["message"], refused


def test_pause_keeps_every_request_and_continue_resumes_it_identically(server, second_ckpt):
    params = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    alone = server.post("/generate", json={"input_ids": PROMPTS[1], "sampling_params": params})
    server.post("/flush_cache")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(server.post(
        "/generate", json={"input_ids": PROMPTS[1], "sampling_params": params}).json()))
    thread.start()
    assert wait_until(lambda: info(server)["num_running_reqs"] == 1, timeout=30, interval=0.01)
    assert server.post("/pause_generation").status_code == 200
    first = info(server)
    assert first["paused"] and first["num_running_reqs"] == 1
    assert not wait_until(lambda: info(server)["num_generated_tokens"]
                          != first["num_generated_tokens"], timeout=0.5, interval=0.05)
    # Paused part-way: an update would have to wait for a request that cannot move.
    status, out = update(server, second_ckpt)
    assert status == 400 and "paused" in out["error"]["message"]
    flushed = server.post("/flush_cache")  # refused while requests run, and no harm done
    assert flushed.status_code == 400
    assert server.post("/continue_generation").status_code == 200
    thread.join(60)
    assert result["output_ids"] == alone.json()["output_ids"]
    assert not info(server)["paused"]
    assert server.post("/flush_cache").status_code == 200


def test_engine_update_from_arrays(fresh, second_ckpt):
    """All the test checkpoint's tensors given as arrays (half numpy, half JAX) turn the
    fresh engine into that model: rows equal its reference."""
    tensors = load_file(f"{BASE}/model.safetensors")
    arrays = {name: (jnp.asarray(a) if i % 2 else a) for i, (name, a) in
              enumerate(sorted(tensors.items()))}
    compiles = fresh.get_server_info()["num_compiles"]
    out = fresh.update_weights_from_arrays(arrays, weight_version="base")
    assert out["weight_version"] == "base"
    ref = ReferenceModel(BASE)
    got = fresh.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_routed_experts=True)
    for r, prompt in zip(got, PROMPTS, strict=True):
        assert r["meta_info"]["weight_version"] == "base"
        np.testing.assert_array_equal(extract_routed_experts_from_meta_info(r),
                                      routed_experts_rows(ref, prompt, r["output_ids"]))
    assert fresh.get_server_info()["num_compiles"] == compiles
    # A subset is fine; half a stacked projection, a wrong shape or a stranger are not.
    one = "model.layers.0.self_attn.q_proj.weight"
    out = fresh.update_weights_from_arrays({one: tensors[one]})
    assert out["num_parameters"] == 1 and out["weight_version"] == "2"  # the counter goes on
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    with pytest.raises(ValueError, match="give all 16 tensors"):
        fresh.update_weights_from_arrays({expert: tensors[expert]})
    with pytest.raises(ValueError, match=r"q_proj\.weight' has shape \(64, 3\)"):
        fresh.update_weights_from_arrays({one: tensors[one][:, :3]})
    with pytest.raises(ValueError, match="unexpected"):
        fresh.update_weights_from_arrays({"lm_head.bias": tensors[one]})
    # A layer past num_hidden_layers (an MTP layer) with no NEXTN draft to update: refused by
    # name, never skipped (a trainer would believe a draft was updated).
    mtp = one.replace("layers.0.", f"layers.{ModelConfig.from_hf(BASE).num_hidden_layers}.")
    with pytest.raises(ValueError, match=rf"MTP layers.*{re.escape(mtp)}.*NEXTN"):
        fresh.update_weights_from_arrays({one: tensors[one], mtp: tensors[one]})
    assert fresh.get_server_info()["weight_version"] == "2"  # failures change nothing


def test_rl_rollout_example_runs():
    """docs/rl_rollouts.md's loop: generate with logprobs and routed experts, update, again."""
    script = os.path.join(os.path.dirname(__file__), "..", "docs", "examples",
                          "rl_rollout_loop.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1 weights step-1:" in done.stdout and "updated to step-2" in done.stdout
