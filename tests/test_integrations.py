"""Framework adapters are optional: ``import sgl_jax`` never imports them, an adapter whose
framework is missing says which extra to install, and the routing-replay row helpers
(``sgl_jax.integrations.tunix.align_routed_experts``, ``to_maxtext_forced_routed_experts``)
work without any framework (sgl_jax/integrations/). The sparse experts of the trainer-side
replay (``grouped_experts``) are checked here against a float64 numpy definition; the rest of
the trainer side needs tunix (tests/tunix)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from sgl_jax.integrations.tunix import (
    UNSET_ROUTED_EXPERT,
    align_routed_experts,
    to_maxtext_forced_routed_experts,
)

L, K = 3, 2


def test_importing_sgl_jax_imports_no_framework():
    code = ("import sys, sgl_jax, sgl_jax.integrations; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tunix'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_the_row_helpers_import_neither_tunix_nor_jax():
    code = ("import sys; from sgl_jax.integrations.tunix import align_routed_experts, "
            "to_maxtext_forced_routed_experts; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tunix', 'jax', 'flax'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("tunix") is not None,
                    reason="tunix is installed here (tests/tunix test the adapter)")
def test_the_tunix_rollout_without_tunix_names_the_extra():
    with pytest.raises(ImportError, match=r"pip install 'sgl_jax\[tunix\]'"):
        from sgl_jax.integrations.tunix import SglJaxRollout  # noqa: F401


# -- align_routed_experts ----------------------------------------------------------------------
def engine_rows(prompt: int, completion: int, sample: int = 0) -> np.ndarray:
    """What the engine returns for a sample: P + C - 1 rows; row i holds ids that name token
    i (and the sample), so a row in the wrong slot shows."""
    n = prompt + completion - 1
    rows = 1000 * sample + 10 * np.arange(n)[:, None, None] + np.arange(L * K).reshape(L, K)
    return rows.astype(np.int32)


def expected(rows: np.ndarray, prompt: int, completion: int, pw: int, cw: int) -> np.ndarray:
    """The definition, token by token: prompt token i sits in column pw - P + i, generated
    token j in column pw + j; generated token C - 1 was never fed, so it has no row."""
    out = np.full((pw + cw, L, K), -1)
    for i in range(prompt):
        if 0 <= pw - prompt + i:
            out[pw - prompt + i] = rows[i]
    for j in range(completion - 1):
        if pw + j < pw + cw:
            out[pw + j] = rows[prompt + j]
    return out


@pytest.mark.parametrize(("prompt", "completion", "pw", "cw"), [
    (3, 4, 5, 6),  # both fit: left padding, right padding
    (7, 4, 4, 6),  # prompt wider than its window: the tail is kept
    (3, 6, 5, 3),  # completion longer than its window: the head is kept
    (6, 5, 2, 2),  # both cut
    (4, 1, 4, 3),  # one generated token: no completion row at all
    (5, 3, 5, 2),  # the window ends exactly after the last completion row
])
def test_rows_land_under_their_tokens(prompt, completion, pw, cw):
    rows = engine_rows(prompt, completion)
    got = align_routed_experts([rows], [completion], pw, cw)
    assert got.shape == (1, pw + cw, L, K) and got.dtype == np.int32
    np.testing.assert_array_equal(got[0], expected(rows, prompt, completion, pw, cw))


def test_a_batch_of_different_lengths_and_the_last_generated_token():
    shapes = [(3, 4), (5, 1), (2, 6)]
    rows = [engine_rows(p, c, b) for b, (p, c) in enumerate(shapes)]
    got = align_routed_experts(rows, [c for _, c in shapes], 5, 6)
    for b, (p, c) in enumerate(shapes):
        np.testing.assert_array_equal(got[b], expected(rows[b], p, c, 5, 6))
        # The last generated token's slot: the engine never fed it, so no replay there.
        assert (got[b, 5 + c - 1] == UNSET_ROUTED_EXPERT).all()
        assert (got[b, 5 + c - 2] >= 0).all() if c > 1 else (got[b, 4] >= 0).all()


def test_dense_layers_stay_unset_in_any_wire_dtype():
    rows = engine_rows(3, 3)
    rows[:, 1] = -1  # layer 1 has no router (mlp_only_layers)
    want = align_routed_experts([rows], [3], 4, 4)
    assert (want[0, :, 1] == -1).all()
    narrow = np.where(rows < 0, 255, rows).astype(np.uint8)  # routed_experts_dtype="uint8"
    np.testing.assert_array_equal(align_routed_experts([narrow], [3], 4, 4), want)
    np.testing.assert_array_equal(align_routed_experts([rows.astype(np.int16)], [3], 4, 4),
                                  want)


def test_inconsistent_rows_are_refused():
    rows = engine_rows(3, 4)
    with pytest.raises(ValueError, match="completion lengths"):
        align_routed_experts([rows, rows], [4], 5, 6)
    with pytest.raises(ValueError, match="non-empty prompt"):
        align_routed_experts([rows], [7], 5, 6)  # 6 rows cannot be P + 7 - 1 with P >= 1
    with pytest.raises(ValueError, match=r"\[n, 3, 2\]"):
        align_routed_experts([rows, rows[:, :2]], [4, 4], 5, 6)
    with pytest.raises(ValueError, match="tokens, layers, top_k"):
        align_routed_experts([rows[0]], [1], 5, 6)
    with pytest.raises(ValueError, match="no samples"):
        align_routed_experts([], [], 5, 6)


# -- to_maxtext_forced_routed_experts -------------------------------------------------------------
def test_maxtext_gets_the_moe_layers_only_with_unset_slots_kept():
    rows = [engine_rows(3, 4), engine_rows(2, 2, 1)]
    for r in rows:
        r[:, 0] = -1  # layer 0 is dense (first_k_dense_replace = 1)
    aligned = align_routed_experts(rows, [4, 2], 4, 5)
    want = aligned[:, :, [1, 2]]
    assert (want == -1).any()  # padding and last-token slots are still there
    for moe_layers in (None, [1, 2], [False, True, True], (2, 1)):
        got = to_maxtext_forced_routed_experts(aligned, moe_layers)
        assert got.shape == (2, 9, 2, K) and got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    # Every layer MoE: nothing dropped.
    full = align_routed_experts([engine_rows(3, 4)], [4], 4, 5)
    np.testing.assert_array_equal(to_maxtext_forced_routed_experts(full), full)


def test_maxtext_layer_selection_is_checked():
    aligned = align_routed_experts([engine_rows(3, 4)], [4], 4, 5)
    with pytest.raises(ValueError, match=r"layers \[2\] hold expert ids"):
        to_maxtext_forced_routed_experts(aligned, [0, 1])
    with pytest.raises(ValueError, match="2 flags for 3 layers"):
        to_maxtext_forced_routed_experts(aligned, [True, True])
    with pytest.raises(ValueError, match="distinct layer indices"):
        to_maxtext_forced_routed_experts(aligned, [0, 3])
    with pytest.raises(ValueError, match="pass moe_layers"):
        to_maxtext_forced_routed_experts(np.full((1, 4, L, K), -1))
    with pytest.raises(ValueError, match=r"\[batch, tokens, layers, top_k\]"):
        to_maxtext_forced_routed_experts(aligned[0])


# -- grouped_experts (the trainer's sparse experts) --------------------------------------------------
def swiglu_definition(x, ids, weights, gate, up, down) -> np.ndarray:
    """float64: sum over a token's k slots of weight * down(silu(x @ gate) * (x @ up))."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for slot, e in enumerate(np.asarray(ids)[n]):
            g, u = x[n] @ gate[e], x[n] @ up[e]
            out[n] += float(weights[n, slot]) * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("method", ["tiles", "ragged"])
def test_grouped_experts_compute_each_token_with_its_experts(method):
    import jax
    import jax.numpy as jnp

    from sgl_jax.integrations.grouped_experts import grouped_swiglu

    rng = np.random.default_rng(0)
    n, h, i, e, k = 37, 8, 6, 10, 3
    x = rng.normal(size=(n, h)).astype(np.float32)
    # Expert 4 in 20 tokens (several tiles of 4 rows), expert 7 in none, the others random.
    others = [0, 1, 2, 3, 5, 6, 8, 9]
    ids = np.array([([4] if t < 20 else []) + list(rng.permutation(others)[:k - (t < 20)])
                    for t in range(n)], np.int32)
    weights = rng.random((n, k)).astype(np.float32)
    gate, up = (rng.normal(size=(e, h, i)).astype(np.float32) / 3 for _ in range(2))
    down = rng.normal(size=(e, i, h)).astype(np.float32) / 3
    got = grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights),
                         jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down), method=method,
                         tile_rows=4)
    np.testing.assert_allclose(np.asarray(got), swiglu_definition(x, ids, weights, gate, up,
                                                                  down), atol=2e-5)

    # Gradients (weights and experts; ids are not differentiable) against the other method.
    def loss(w, g, m):
        return jnp.sum(grouped_swiglu(jnp.asarray(x), jnp.asarray(ids), w, g, jnp.asarray(up),
                                      jnp.asarray(down), method=m, tile_rows=4) ** 2)

    other = "ragged" if method == "tiles" else "tiles"
    grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(weights), jnp.asarray(gate), method)
    want = jax.grad(loss, argnums=(0, 1))(jnp.asarray(weights), jnp.asarray(gate), other)
    for a, b in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(grads[1][7]).max()) == 0.0  # an expert no token chose: no gradient
