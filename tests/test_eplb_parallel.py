"""EPLB at runtime on a mesh of 4 fake CPU devices (ep=4, 16 logical + 4 redundant experts).

A worker process (``XLA_FLAGS=--xla_force_host_platform_device_count=4``, as in
tests/test_parallel.py) runs the backend scenario (tests/backend_scenario.py) before a
rebalance, drives a skewed workload (one token repeated: the same experts for most tokens),
rebalances from the recorder's ``stat`` counts, and runs the scenario again; a second runner
rebalances automatically every 2 forward passes, i.e. during the scenario. Every run must
match the float64 reference (routed rows exactly: they stay LOGICAL), the step must not be
recompiled by a rebalance, and the per-device load imbalance of the skewed workload (max / mean
token-expert assignments per device, per layer, counted through the deterministic replica
choice) must drop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, fake_devices_flags
from tests.backend_scenario import assert_matches, reference_scenario, run_scenario

REPO = Path(__file__).absolute().parents[1]
DEVICES = 4
SKEW_TOKENS = [7] * 48  # one token repeated: a skewed expert load
BACKENDS = ("dense", "ragged")
INIT_LOCATION = list(range(15, -1, -1)) + [0, 1, 2, 3]


def _args(backend: str, **extra: Any) -> Any:
    from sgl_jax.srt.server_args import ServerArgs

    return ServerArgs(
        ep_size=DEVICES, max_running_requests=4, chunked_prefill_size=32,
        precompile_token_paddings=[32], precompile_bs_paddings=[4], max_total_tokens=256,
        attention_block_size=16, enable_return_routed_experts=True, moe_backend=backend,
        enable_eplb=True, ep_num_redundant_experts=4, **extra)


def _skewed(runner: Any) -> np.ndarray:
    """Prefills the skewed prompt (two chunks); returns its routed rows [T, layers, k]."""
    from sgl_jax.srt.forward_batch_info import ForwardMode
    from tests.model_driver import ModelDriver

    driver = ModelDriver(runner, rng_seed=0)
    seq = driver.new_seq()
    _, (first,) = driver.step(ForwardMode.EXTEND, [seq], [SKEW_TOKENS[:32]])
    _, (second,) = driver.step(ForwardMode.EXTEND, [seq], [SKEW_TOKENS[32:]])
    driver.release(seq)
    return np.concatenate([first, second])


def _device_tokens(rows: np.ndarray, runner: Any) -> np.ndarray:
    """[moe_layers, ep]: token-expert assignments each device computes for ``rows`` (one
    batch of the skewed prompt per chunk, as the forward split them over replicas)."""
    from sgl_jax.srt.layers.moe.placement import physical_ids_np

    cfg = runner.model_config
    per_device = cfg.num_physical_experts // DEVICES
    out = np.zeros((len(cfg.moe_layer_ids), DEVICES), np.int64)
    for i, layer in enumerate(cfg.moe_layer_ids):
        table = runner.expert_placement.physical_order(layer)
        for chunk in (rows[:32, layer], rows[32:, layer]):  # the two prefill batches
            phys = physical_ids_np(chunk, table, cfg.num_redundant_experts + 1)
            out[i] += np.bincount(phys.reshape(-1) // per_device, minlength=DEVICES)
    return out


def _placement_ok(runner: Any) -> bool:
    """Every device's shard of every stacked expert weight holds, at physical row p, the
    checkpoint's logical expert ``physical_to_logical[p]``."""
    from safetensors import safe_open

    cfg = runner.model_config
    per_device = cfg.num_physical_experts // DEVICES
    position = {dev: idx for idx, dev in np.ndenumerate(runner.mesh.devices)}
    layers = runner.model.model.layers
    ok = True
    with safe_open(os.path.join(cfg.model_path, "model.safetensors"), "numpy") as f:
        for layer in cfg.moe_layer_ids:
            table = runner.expert_placement.physical_order(layer)
            for name, proj in (("w_gate", "gate_proj"), ("w_down", "down_proj")):
                logical = np.stack([
                    f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight").T
                    for e in range(cfg.num_experts)])
                for shard in getattr(layers[layer].mlp, name)[...].addressable_shards:
                    d, _ = position[shard.device]
                    want = logical[table[d * per_device:(d + 1) * per_device]]
                    ok &= np.array_equal(np.asarray(shard.data), want)
    return bool(ok)


def _worker(out_dir: str) -> None:
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.srt.utils import enable_compilation_cache

    enable_compilation_cache(ServerArgs())
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH)
    results: dict[str, Any] = {}
    for backend in BACKENDS:
        runner = ModelRunner(_args(backend), cfg)
        assert runner.model.model.layers[0].mlp.w_gate[...].shape[0] == cfg.num_experts + 4
        before = run_scenario(runner)
        runner.expert_recorder.stop()  # the window EPLB balances: the skewed workload only
        runner.expert_recorder.start()
        rows = _skewed(runner)
        compiles = runner.num_compiles
        load_before = _device_tokens(rows, runner)
        placed_before = _placement_ok(runner)
        rebalance = runner.rebalance_experts()
        placed_after = _placement_ok(runner)
        load_after = _device_tokens(rows, runner)
        rows_after = _skewed(runner)  # the same prompt after: same logical rows
        after = run_scenario(runner)
        np.savez(os.path.join(out_dir, f"{backend}_before.npz"), **before)
        np.savez(os.path.join(out_dir, f"{backend}_after.npz"), **after)
        # A weight update after a rebalance stacks the experts by the current placement.
        from sgl_jax.srt.model_executor.weight_updater import WeightUpdater

        WeightUpdater(runner).update_from_disk(cfg.model_path)
        placed_updated = _placement_ok(runner)
        # During: rebalanced every 2 forward passes, from the counts so far.
        auto = ModelRunner(_args(backend, eplb_rebalance_num_iterations=2), cfg)
        _skewed(auto)
        during = run_scenario(auto)
        np.savez(os.path.join(out_dir, f"{backend}_during.npz"), **during)
        results[backend] = {
            "compiles_before": compiles, "compiles_after": runner.num_compiles,
            "rows_equal": bool(np.array_equal(rows, rows_after)),
            "load_before": load_before.tolist(), "load_after": load_after.tolist(),
            "rebalance": rebalance, "auto_rebalances": auto.eplb.rebalances,
            "placed": [placed_before, placed_after, placed_updated],
            "moved": rebalance["physical_to_logical"] != [
                list(map(int, (np.arange(20) % 16)))] * 4,
        }
    # --init-expert-location: a placement of our own (experts reversed, then 0..3 again).
    spec = os.path.join(out_dir, "location.json")
    with open(spec, "w") as f:
        json.dump({"physical_to_logical": INIT_LOCATION}, f)
    runner = ModelRunner(_args("ragged", init_expert_location=spec), cfg)
    np.savez(os.path.join(out_dir, "init.npz"), **run_scenario(runner))
    results["init_placed"] = _placement_ok(runner)
    results["init_table"] = runner.expert_placement.physical_order(0).tolist()
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(DEVICES)}
        proc = subprocess.run([sys.executable, "-m", "tests.test_eplb_parallel", tmp], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-4000:]
        with open(os.path.join(tmp, "results.json")) as f:
            out = json.load(f)
        for backend in BACKENDS:
            for when in ("before", "during", "after"):
                with np.load(os.path.join(tmp, f"{backend}_{when}.npz")) as z:
                    out[backend][when] = dict(z)
        with np.load(os.path.join(tmp, "init.npz")) as z:
            out["init"] = dict(z)
        out["reference"] = reference_scenario(TEST_MODEL_PATH)
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("when", ["before", "during", "after"])
def test_matches_reference_around_a_rebalance(results, backend, when):
    assert_matches(results[backend][when], results["reference"], 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_tokens_and_rows_and_no_recompilation(results, backend):
    r = results[backend]
    for key in r["before"]:
        if key.startswith("rows"):
            np.testing.assert_array_equal(r["before"][key], r["after"][key])
            np.testing.assert_array_equal(r["before"][key], r["during"][key])
            # LOGICAL ids (captured before the replica mapping): none is a physical slot >= E.
            assert 0 <= r["after"][key].min() and r["after"][key].max() < 16
        else:  # greedy tokens
            for when in ("during", "after"):
                np.testing.assert_array_equal(r["before"][key].argmax(-1),
                                              r[when][key].argmax(-1))
    assert r["rows_equal"]
    assert r["compiles_after"] == r["compiles_before"]
    assert r["auto_rebalances"] >= 2


def test_init_expert_location(results):
    assert results["init_table"] == INIT_LOCATION
    assert results["init_placed"]
    assert_matches(results["init"], results["reference"], 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_follow_the_placement(results, backend):
    """Before and after the rebalance (the gather moved rows), and after a weight update."""
    assert results[backend]["moved"]
    assert results[backend]["placed"] == [True, True, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_imbalance_drops(results, backend):
    from sgl_jax.srt.layers.moe.balancing import imbalance

    r = results[backend]
    before, after = np.array(r["load_before"]), np.array(r["load_after"])
    assert (before.sum(1) == after.sum(1)).all()  # same assignments, other devices
    ib, ia = imbalance(before), imbalance(after)
    print(f"{backend}: tokens per device before {before.tolist()} after {after.tolist()}; "
          f"imbalance {np.round(ib, 3).tolist()} -> {np.round(ia, 3).tolist()}")
    # Perfect after (4 hot experts, 2 replicas each, 2 per device); never worse per layer.
    assert (ia <= ib).all() and ia.max() < ib.max() and ia.mean() < ib.mean(), (ib, ia)
    # The rebalance's own figures (replicas taking load / replicas) say the same.
    np.testing.assert_allclose(r["rebalance"]["imbalance_before"], ib)
    np.testing.assert_allclose(r["rebalance"]["imbalance_after"], ia)


if __name__ == "__main__":
    _worker(sys.argv[1])
