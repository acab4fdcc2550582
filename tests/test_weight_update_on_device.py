"""Weights from the trainer, on device (M18 item 2): single-process ``update_weights_from_arrays``
with JAX arrays.

A single-process engine on the test checkpoint is given a second checkpoint's tensors (same
shapes, ``make_random_model`` seed 1) as JAX arrays. Its outputs must then be the independent
float64 reference's of that checkpoint (tokens and routed-experts rows), with no recompilation,
no host transfer (the update runs under a process-wide transfer guard; the engine reports the
one byte of its finiteness verdict), and live device memory never above what it was plus the
largest parameter, the old parameters freed after. Bad arrays are refused naming the problem,
and nothing changes. The hand-off token means nothing to a scheduler in another process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers import array_handoff
from sgl_jax.srt.managers.control import UpdateWeightsInProcess
from sgl_jax.srt.model_executor.memory_occupation import live_device_bytes
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, fake_devices_flags, wait_until
from tests.engine_utils import decoded_rows, expected_rows, prompt_ids, reference_greedy

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
PROMPTS = [prompt_ids(700 + i, 5 + 11 * i) for i in range(3)]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
REPO = Path(__file__).absolute().parents[1]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(**engine_args(enable_single_process=True, enable_return_routed_experts=True))
    yield eng
    eng.shutdown()


def device_tensors(path: str) -> dict[str, jax.Array]:
    return {name: jnp.asarray(a) for name, a in load_file(f"{path}/model.safetensors").items()}


def largest_parameter_bytes(tensors: dict[str, jax.Array]) -> int:
    """The bytes of the largest served parameter (float32 on the CPU): a stacked expert
    projection is the sum of its experts' tensors."""
    sizes: dict[str, int] = defaultdict(int)
    for name, a in tensors.items():
        parts = name.split(".")
        key = ".".join(parts[:5] + parts[6:]) if ".experts." in name else name
        sizes[key] += a.size * 4
    return max(sizes.values())


@contextmanager
def no_host_transfers_anywhere():
    """A process-wide guard (every thread, the scheduler's too, unless it sets its own):
    implicit transfers between host and devices raise."""
    saved = (jax.config.jax_transfer_guard_host_to_device,
             jax.config.jax_transfer_guard_device_to_host)
    jax.config.update("jax_transfer_guard_host_to_device", "disallow")
    jax.config.update("jax_transfer_guard_device_to_host", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard_host_to_device", saved[0])
        jax.config.update("jax_transfer_guard_device_to_host", saved[1])


def generate(engine) -> list[dict]:
    return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_routed_experts=True)


def tokens_and_rows(out: dict) -> tuple:
    return out["output_ids"], out["meta_info"]["routed_experts"]


def check_against_reference(outs: list[dict], path: str) -> None:
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, GREEDY["max_new_tokens"], path)
        np.testing.assert_array_equal(decoded_rows(out, L, K),
                                      expected_rows(ids, out["output_ids"], path))


def test_update_from_jax_arrays_on_device(engine, second_ckpt):
    check_against_reference(generate(engine), TEST_MODEL_PATH)
    compiles = engine.get_server_info()["num_compiles"]
    tensors = device_tensors(second_ckpt)
    jax.block_until_ready(tensors)
    before = live_device_bytes()  # parameters, KV cache and the new arrays
    with no_host_transfers_anywhere():
        out = engine.update_weights_from_arrays(tensors, weight_version="second",
                                                measure_memory=True)
    after = live_device_bytes()
    assert out["success"] and out["weight_version"] == "second"
    assert out["num_parameters"] == len([n for n in tensors if ".experts." not in n]) \
        + 3 * L  # every parameter; a stacked expert projection counts once
    assert out["host_bytes"] == 1  # the finiteness verdict, one bool
    largest = largest_parameter_bytes(tensors)
    # At the update's maximal residency the largest new parameter and its predecessor both
    # exist: at most that much above the start; the old ones are freed by the end.
    assert before < out["peak_device_bytes"] <= before + largest, (before, largest, out)
    assert after <= before, (before, after)
    outs = generate(engine)
    assert all(o["meta_info"]["weight_version"] == "second" for o in outs)
    check_against_reference(outs, second_ckpt)
    assert engine.get_server_info()["num_compiles"] == compiles
    assert not array_handoff._held  # the registry let go of the arrays
    # The engine holds copies: the caller may delete (or donate) its arrays.
    for a in tensors.values():
        a.delete()
    check_against_reference(generate(engine), second_ckpt)


def test_nested_state_with_a_name_mapping(engine, second_ckpt):
    """A nested dict (as ``nnx.State`` nests) with ``names`` as a function and as a dict."""
    tensors = device_tensors(TEST_MODEL_PATH)
    nested: dict = {}
    for name, a in tensors.items():
        *parents, leaf = name.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(int(p) if p.isdigit() else p, {})
        node[leaf] = a
    out = engine.update_weights_from_arrays(
        nested, names=lambda path: ".".join(str(p) for p in path))
    assert out["success"]
    check_against_reference(generate(engine), TEST_MODEL_PATH)
    # A dict keyed by dotted paths; leaves it does not name are not sent (a subset).
    one = "model.norm.weight"
    out = engine.update_weights_from_arrays(nested, names={one: one})
    assert out["num_parameters"] == 1
    with pytest.raises(ValueError, match="to two leaves"):
        engine.update_weights_from_arrays(nested, names=lambda path: one)


def test_bad_arrays_change_nothing(engine):
    before = generate(engine)
    version = engine.get_server_info()["weight_version"]
    good = device_tensors(TEST_MODEL_PATH)
    expert = "model.layers.2.mlp.experts.5.down_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "non-finite": ({**good, expert: good[expert].at[1, 2].set(jnp.inf)},
                       r"experts\.5\.down_proj\.weight' has non-finite"),
        "shape": ({**good, q: good[q][:, :3]}, r"q_proj\.weight' has shape \(64, 3\)"),
        "dtype": ({**good, q: good[q].astype(jnp.int32)}, "must be floating point"),
        "name": ({**good, "lm_head.bias": good[q]}, "unexpected"),
        "half an expert stack": ({expert: good[expert]}, "give all 16 tensors"),
    }
    for case, (arrays, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.update_weights_from_arrays(arrays)
        assert engine.get_server_info()["weight_version"] == version, case
    assert not array_handoff._held
    assert [tokens_and_rows(o) for o in generate(engine)] == [tokens_and_rows(o) for o in before]


def test_running_requests_finish_first_or_are_aborted(engine, second_ckpt):
    results: dict[str, dict] = {}

    def long_request(name: str) -> threading.Thread:
        def run() -> None:
            results[name] = engine.generate(input_ids=PROMPTS[0], max_new_tokens=300,
                                            temperature=0.0, ignore_eos=True)
        thread = threading.Thread(target=run)
        thread.start()
        assert wait_until(lambda: engine.get_server_info()["num_running_reqs"] == 1,
                          timeout=30, interval=0.01)
        return thread

    version = engine.get_server_info()["weight_version"]
    thread = long_request("drained")
    out = engine.update_weights_from_arrays(device_tensors(second_ckpt))  # waits for it
    thread.join(30)
    assert results["drained"]["meta_info"]["finish_reason"]["type"] == "length"
    assert results["drained"]["meta_info"]["weight_version"] == version
    assert out["weight_version"] != version

    thread = long_request("aborted")
    out = engine.update_weights_from_arrays(device_tensors(TEST_MODEL_PATH),
                                            abort_all_requests=True)
    thread.join(30)
    assert out["success"]
    assert results["aborted"]["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "aborted for a weight update"}
    check_against_reference(generate(engine), TEST_MODEL_PATH)


def test_a_token_means_nothing_to_a_scheduler_process():
    """Multi-process: the scheduler has no arrays under any token the caller's process holds
    (and update_weights_from_arrays goes through the socket as host bytes, as before)."""
    with Engine(**engine_args()) as eng:
        token = array_handoff.hand_over({"model.norm.weight": jnp.ones(CFG.hidden_size)})
        try:
            with pytest.raises(ValueError, match="only an engine in the caller's process"):
                eng._control(UpdateWeightsInProcess(handle=token))
        finally:
            array_handoff.withdraw(token)
        out = eng.update_weights_from_arrays(
            {"model.norm.weight": jnp.ones(CFG.hidden_size, jnp.float32)})
        assert out["num_parameters"] == 1 and out["host_bytes"] == 4 * CFG.hidden_size


def test_reshards_on_a_mesh():
    """Arrays laid out another way (replicated over 4 fake CPU devices) are resharded on the
    devices into a 2 x 2 mesh's engine (tests/on_device_update_worker.py)."""
    env = {**os.environ, "XLA_FLAGS": fake_devices_flags(4),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.on_device_update_worker",
                           json.dumps([PROMPTS, GREEDY])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["host_bytes"] == 1 and report["compiles_before"] == report["compiles_after"]
    outs = [{"output_ids": ids, "meta_info": {"routed_experts": rows,
                                              "completion_tokens": len(ids)}}
            for ids, rows in zip(report["output_ids"], report["routed_experts"], strict=True)]
    check_against_reference(outs, report["model_path"])


def test_colocated_loop_example_runs():
    """docs/rl_rollouts.md's colocated loop: generate -> score -> train -> sync ->
    release/resume, in one process, the sync on device (1 host byte: the finiteness verdict)."""
    script = os.path.join(os.path.dirname(__file__), "..", "docs", "examples",
                          "colocated_loop.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("prompt reused by 4 of 4") == 2 and out.count("1 host byte(s)") == 2
    assert out.rstrip().endswith("done")
