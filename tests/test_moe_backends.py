"""The MoE expert backends (``dense``, ``ragged``) against each other and a per-token reference.

Both backends consume the same (topk_ids, topk_weights), so they must compute the same layer:
ragged == dense to float32 rounding, both == a float64 numpy loop written from the definition
(sum over a token's k experts of w_i * down(silu(gate(x)) * up(x))), with duplicate-heavy
routing, a non-identity physical order, sentinel (non-local) assignments, and under
``shard_map`` with expert and tensor parallelism. The parallel configurations run in one
subprocess whose ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before JAX
starts (this process already initialised JAX with one CPU device); its outputs are compared
here with this process's single-device dense result.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.moe.dense import combine_weights, dense_experts, experts_forward
from sgl_jax.srt.layers.moe.ep_moe import W_DOWN_SPEC, W_GATE_UP_SPEC, ep_moe_forward
from sgl_jax.srt.layers.moe.experts import (
    MOE_BACKEND_CHOICES,
    create_moe_backend,
    get_moe_backend,
    resolve_moe_backend,
)
from sgl_jax.srt.layers.moe.ragged import ragged_experts, sorted_assignments
from sgl_jax.testing import fake_devices_flags

REPO = Path(__file__).absolute().parents[1]
REL_TOL = 1e-5
BF16_TOL = 3e-2
SHAPE = {"hidden": 64, "experts": 16, "top_k": 4, "inter": 32}  # the bundled model's MoE
STRIDED = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
REVERSED = [[15, 14, 13, 12, 11, 10, 9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]
# name -> (ep, tp, mapping table or None for contiguous); run by the 8-device worker.
PARALLEL: dict[str, tuple[int, int, list[list[int]] | None]] = {
    "mesh1": (1, 1, None),
    "ep2": (2, 1, None),
    "ep4_strided": (4, 1, STRIDED),
    "tp2": (1, 2, None),
    "tp2_ep2_reversed": (2, 2, REVERSED),
}
PARALLEL_TOKENS = (1, 37)
# a collective of the compiled program: its result type and op, e.g. "f32[37,64]{1,0} all-reduce"
COLLECTIVE = re.compile(r"= (\S+ (?:all-reduce|all-gather|all-to-all|reduce-scatter|"
                        r"collective-permute)(?:-start)?)\(")
BACKENDS = ("dense", "ragged")


def make_case(seed: int, tokens: int, routing: str = "random", hidden: int = 64,
              experts: int = 16, top_k: int = 4, inter: int = 32) -> dict[str, np.ndarray]:
    """Float32 inputs of one MoE layer; weights in LOGICAL order. Routing "random": k distinct
    experts per token with softmax-like weights; "same": every token routed to the same k
    experts (one huge group per expert, all others empty)."""
    rng = np.random.default_rng(seed)
    if routing == "same":
        ids = np.tile(rng.permutation(experts)[:top_k], (tokens, 1))
    else:
        ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    weights = rng.random((tokens, top_k)) + 0.1
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((tokens, hidden)).astype(np.float32),
        "topk_ids": ids.astype(np.int32),
        "topk_weights": (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32),
        "w_gate": (rng.standard_normal((experts, hidden, inter)) * scale).astype(np.float32),
        "w_up": (rng.standard_normal((experts, hidden, inter)) * scale).astype(np.float32),
        "w_down": (rng.standard_normal((experts, inter, hidden)) * scale).astype(np.float32),
    }


def physical(case: dict[str, np.ndarray], order: Sequence[int]) -> dict[str, np.ndarray]:
    """The case with its weights stacked in ``order`` (row i = logical expert order[i])."""
    idx = np.asarray(order)
    return {k: v[idx] if k.startswith("w_") else v for k, v in case.items()}


def reference_moe(case: dict[str, np.ndarray]) -> np.ndarray:
    """float64, per token, from the definition (weights in logical order)."""
    x, ids, w = case["x"].astype(np.float64), case["topk_ids"], case["topk_weights"]
    g, u, d = (case[k].astype(np.float64) for k in ("w_gate", "w_up", "w_down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t], strict=True):
            gate, up = x[t] @ g[e], x[t] @ u[e]
            out[t] += wt * ((gate / (1.0 + np.exp(-gate)) * up) @ d[e])
    return out


def rel_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_layer(case: dict[str, np.ndarray], order: Sequence[int], backend: str,
              dtype: jnp.dtype | None = None) -> np.ndarray:
    """One jitted ``ep_moe_forward`` (no mesh in context) with the weights in ``order``."""
    args = physical(case, order)
    cast = {k: jnp.asarray(v, dtype) if dtype is not None and v.dtype == np.float32 else v
            for k, v in args.items()}
    return np.asarray(_layer_fn(tuple(order), backend)(cast).astype(jnp.float32))


@functools.cache
def _layer_fn(order: tuple[int, ...], backend: str) -> Any:
    return jax.jit(lambda a: ep_moe_forward(
        a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"], order,
        backend=get_moe_backend(backend),
    ))


IDENTITY = tuple(range(SHAPE["experts"]))
SHUFFLED = tuple(int(e) for e in np.random.default_rng(3).permutation(SHAPE["experts"]))


# -- single device ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,routing,order", [
    (1, "random", IDENTITY),
    (37, "random", SHUFFLED),
    (130, "random", IDENTITY),
    (29, "same", SHUFFLED),
])
def test_ragged_matches_dense_and_reference(tokens, routing, order):
    case = make_case(tokens, tokens, routing)
    ref = reference_moe(case)
    dense = run_layer(case, order, "dense")
    ragged = run_layer(case, order, "ragged")
    assert dense.shape == ragged.shape == ref.shape
    assert rel_err(ragged, dense) < REL_TOL
    assert rel_err(dense, ref) < REL_TOL
    assert rel_err(ragged, ref) < REL_TOL


def test_dense_is_exactly_the_previous_formula():
    """The dense backend through local rows is bit-identical to combining by logical ids."""
    case = physical(make_case(5, 37), SHUFFLED)

    @jax.jit
    def previous(a: dict[str, jax.Array]) -> jax.Array:
        weights = combine_weights(a["topk_ids"], a["topk_weights"], jnp.asarray(SHUFFLED))
        return experts_forward(a["x"], a["w_gate"], a["w_up"], a["w_down"], weights)

    want = np.asarray(previous(case))
    np.testing.assert_array_equal(run_layer(make_case(5, 37), SHUFFLED, "dense"), want)


def test_sentinel_assignments_contribute_nothing_even_if_ragged_dot_writes_garbage(monkeypatch):
    """A device's non-local assignments (row E_l) are excluded from the groups; whatever
    ``ragged_dot`` leaves in the rows past ``sum(group_sizes)`` (here: NaN, as an unwritten
    kernel output might hold) never reaches the result."""
    case = make_case(11, 23)
    local_rows = 6  # this "device" holds logical experts 0..5 as rows 0..5
    local = np.where(case["topk_ids"] < local_rows, case["topk_ids"], local_rows).astype(np.int32)
    assert (local == local_rows).any() and (local < local_rows).any()
    weights = [case[k][:local_rows] for k in ("w_gate", "w_up", "w_down")]
    args = (case["x"], local, case["topk_weights"], *weights)

    order, weight, inverse, sizes = jax.jit(sorted_assignments, static_argnums=2)(
        local, case["topk_weights"], local_rows)
    counts = np.bincount(local.reshape(-1), minlength=local_rows + 1)
    np.testing.assert_array_equal(sizes, counts[:local_rows])  # the sentinel is in no group
    stable = np.argsort(local.reshape(-1), kind="stable")
    np.testing.assert_array_equal(np.asarray(order), stable)
    np.testing.assert_array_equal(np.asarray(weight),
                                  np.asarray(case["topk_weights"], np.float32).reshape(-1)[stable])
    np.testing.assert_array_equal(np.asarray(inverse)[stable], np.arange(stable.size))

    real_ragged_dot = jax.lax.ragged_dot

    def garbage_tail(lhs, rhs, group_sizes, **kw):
        out = real_ragged_dot(lhs, rhs, group_sizes, **kw)
        tail = jnp.arange(lhs.shape[0]) >= jnp.sum(group_sizes)
        return jnp.where(tail[:, None], jnp.nan, out)

    want = np.asarray(jax.jit(dense_experts)(*args))
    monkeypatch.setattr(jax.lax, "ragged_dot", garbage_tail)
    got = np.asarray(jax.jit(ragged_experts)(*args))
    assert np.isfinite(got).all()
    assert rel_err(got, want) < REL_TOL


def test_bfloat16_backends_agree():
    case = make_case(17, 64)
    ref = reference_moe(case)
    dense = run_layer(case, SHUFFLED, "dense", jnp.bfloat16)
    ragged = run_layer(case, SHUFFLED, "ragged", jnp.bfloat16)
    assert rel_err(ragged, dense) < BF16_TOL
    assert rel_err(dense, ref) < BF16_TOL and rel_err(ragged, ref) < BF16_TOL


def test_resolve_moe_backend():
    assert MOE_BACKEND_CHOICES == ("auto", "dense", "ragged", "gmm")
    assert resolve_moe_backend("auto", "tpu") == "gmm"
    assert resolve_moe_backend("auto", "cpu") == "dense"
    assert resolve_moe_backend("auto", "gpu") == "dense"
    for platform in ("cpu", "gpu", "tpu"):
        assert resolve_moe_backend("dense", platform) == "dense"
        assert resolve_moe_backend("ragged", platform) == "ragged"
    with pytest.raises(ValueError, match="unknown MoE backend 'megablox'; valid choices: auto, "
                                         "dense, ragged, gmm"):
        resolve_moe_backend("megablox", "tpu")
    with pytest.raises(ValueError, match="resolve 'auto' with resolve_moe_backend first"):
        get_moe_backend("auto")
    # The object the runner builds once: resolved for the platform, dense when batch-invariant.
    assert create_moe_backend("auto", "tpu").name == "gmm"
    assert create_moe_backend("auto", "tpu", batch_invariant=True).name == "dense"
    assert create_moe_backend("dense", "cpu").compute is dense_experts


# -- expert and tensor parallelism (8 fake CPU devices, one subprocess) -------------------------
def _worker(out_dir: str) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    specs = {"w_gate": W_GATE_UP_SPEC, "w_up": W_GATE_UP_SPEC, "w_down": W_DOWN_SPEC}
    results: dict[str, np.ndarray] = {}
    collectives: dict[str, list[str]] = {}
    for name, (ep, tp, table) in PARALLEL.items():
        order = tuple(np.asarray(table).reshape(-1).tolist()) if table else IDENTITY
        mesh = Mesh(np.array(jax.devices()[: ep * tp]).reshape(ep, tp), ("expert", "tensor"))
        for backend in BACKENDS:
            fn = jax.jit(lambda a, order=order, backend=backend: ep_moe_forward(
                a["x"], a["topk_ids"], a["topk_weights"], a["w_gate"], a["w_up"], a["w_down"],
                order, backend=get_moe_backend(backend),
            ))
            for tokens in PARALLEL_TOKENS:
                args = {
                    k: jax.device_put(v, NamedSharding(mesh, P(*specs.get(k, ()))))
                    for k, v in physical(make_case(tokens, tokens), order).items()
                }
                with jax.set_mesh(mesh):
                    compiled = fn.lower(args).compile()
                results[f"{name}/{backend}/{tokens}"] = np.asarray(compiled(args))
                collectives[f"{name}/{backend}/{tokens}"] = [
                    m.group(1) for m in COLLECTIVE.finditer(compiled.as_text())
                ]
    np.savez(os.path.join(out_dir, "parallel.npz"), **results)
    with open(os.path.join(out_dir, "collectives.json"), "w") as f:
        json.dump(collectives, f)


@pytest.fixture(scope="module", autouse=True)
def parallel_worker() -> Any:
    """Started before this module's first test, so that it compiles while they run."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": fake_devices_flags(8)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_moe_backends", json.dumps({"out": tmp})],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            yield proc, tmp
        finally:
            if proc.poll() is None:  # a test failed or was deselected before it was awaited
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def parallel_results(parallel_worker: Any) -> dict[str, Any]:
    proc, tmp = parallel_worker
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"8-device worker failed:\n{stderr[-4000:]}"
    with open(os.path.join(tmp, "collectives.json")) as f:
        out: dict[str, Any] = {"collectives": json.load(f)}
    with np.load(os.path.join(tmp, "parallel.npz")) as z:
        out["arrays"] = dict(z)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(PARALLEL))
def test_parallel_matches_single_device_dense(parallel_results, name, backend):
    for tokens in PARALLEL_TOKENS:
        case = make_case(tokens, tokens)
        want = run_layer(case, IDENTITY, "dense")
        key = f"{name}/{backend}/{tokens}"
        got = parallel_results["arrays"][key]
        assert got.shape == want.shape
        assert rel_err(got, want) < REL_TOL, key
        # The only communication: one float32 all-reduce of [T, H] (trivial on one device);
        # x and the weights are never gathered, nothing is sent all-to-all.
        one_psum = [f"f32[{tokens},{SHAPE['hidden']}]{{1,0}} all-reduce"]
        assert parallel_results["collectives"][key] == one_psum, key


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1])["out"])
