"""The fused per-head RMSNorm + rotary kernel (``layers/norm_rope.py``) in Pallas interpret
mode against the jnp path it replaces on TPU (``rms_norm`` then ``apply_rotary``), and both
against a float64 reference written from the definitions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import RopeScaling
from sgl_jax.srt.layers import norm_rope
from sgl_jax.srt.layers.norm import rms_norm
from sgl_jax.srt.layers.rotary import apply_rotary

THETA = 1e6
EPS = 1e-6


def reference(x: np.ndarray, weight: np.ndarray | None, positions: np.ndarray,
              scale: float = 1.0) -> np.ndarray:
    """float64 [T, heads, D]: RMSNorm of each head (if a weight), then "rotate half"."""
    x = x.astype(np.float64)
    if weight is not None:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * weight
    d = x.shape[-1]
    inv = 1.0 / THETA ** (np.arange(0, d, 2) / d)
    ang = positions[:, None, None] * inv
    cos, sin = np.cos(ang) * scale, np.sin(ang) * scale
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("block", [0, 2])
@pytest.mark.parametrize("heads_axis", [False, True])
def test_kernel_reads_its_block_of_columns(block, heads_axis):
    """x several projections wide (the fused q/k/v): the kernel's result is its result on
    block ``block`` of ``heads * D`` columns alone, written ``[T, heads, D]`` if asked."""
    rng = np.random.default_rng(block)
    tokens, heads, d = 40, 2, 128
    wide = jnp.asarray(rng.standard_normal((tokens, 3 * heads * d)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal(d), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 2048, tokens), jnp.int32)
    got = norm_rope.norm_rope(wide, weight, positions, THETA, heads, EPS, interpret=True,
                              head_dim=d, column_block=block, heads_axis=heads_axis)
    cols = wide[:, block * heads * d:(block + 1) * heads * d]
    want = norm_rope.norm_rope(cols, weight, positions, THETA, heads, EPS, interpret=True)
    if heads_axis:
        assert got.shape == (tokens, heads, d)
        got = got.reshape(tokens, heads * d)
    assert got.shape == (tokens, heads * d)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens", [37, 300])  # one partial block; two blocks, padded
def test_kernel_equals_the_jnp_path(dtype, with_norm, tokens):
    rng = np.random.default_rng(tokens)
    heads, d = 3, 128
    x = jnp.asarray(rng.standard_normal((tokens, heads * d)) * 3, dtype)
    weight = jnp.asarray(rng.standard_normal(d), dtype) if with_norm else None
    positions = jnp.asarray(rng.integers(0, 2048, tokens), jnp.int32)
    got = norm_rope.norm_rope(x, weight, positions, THETA, heads, EPS if with_norm else None,
                              interpret=True)
    heads_view = x.reshape(tokens, heads, d)
    normed = rms_norm(heads_view, weight, EPS) if with_norm else heads_view
    want = apply_rotary(normed, positions, THETA).reshape(tokens, heads * d)
    assert got.shape == x.shape and got.dtype == dtype
    g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    else:  # the norm's float32 sum may be added in another order: at most 1 bf16 ulp apart
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-2)
        assert np.mean(g == w) > 0.99
    ref = reference(np.asarray(x.astype(jnp.float32)).reshape(tokens, heads, d),
                    None if weight is None else np.asarray(weight.astype(jnp.float32)),
                    np.asarray(positions)).reshape(tokens, heads * d)
    # float32 angles: position * frequency rounded (as every implementation computes them)
    tol = 2e-3 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(g, ref, rtol=tol, atol=tol)


def test_yarn_scales_cos_and_sin():
    rng = np.random.default_rng(1)
    tokens, heads, d = 20, 2, 128
    yarn = RopeScaling(factor=4.0, original_max_position_embeddings=4096, mscale=1.0,
                       mscale_all_dim=0.5)
    x = jnp.asarray(rng.standard_normal((tokens, heads * d)), jnp.float32)
    positions = jnp.arange(tokens, dtype=jnp.int32) * 997
    got = norm_rope.norm_rope(x, None, positions, THETA, heads, None, interpret=True,
                              yarn=yarn)
    want = apply_rotary(x.reshape(tokens, heads, d), positions, THETA, yarn=yarn)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want).reshape(tokens, -1),
                               rtol=1e-5, atol=1e-5)


def test_supported_layouts():
    assert norm_rope.supported(128, 128, False, 8, 4)
    assert not norm_rope.supported(128, 64, False, 8, 4)  # partial rotary (GLM-4.5)
    assert not norm_rope.supported(128, 128, True, 8, 4)  # interleaved pairs
    assert not norm_rope.supported(64, 64, False, 8, 4)  # half a lane tile per head
    assert not norm_rope.supported(128, 128, False, 2, 4)  # a device with half a head
    jax.clear_caches()


def test_parts_in_one_call_equal_one_call_each():
    """q and k of the fused q/k/v in one kernel call (the table read once, each part's
    columns in place, q written ``[T, heads, D]``): what a call per part gives."""
    rng = np.random.default_rng(11)
    tokens, d = 40, 128
    wide = jnp.asarray(rng.standard_normal((tokens, (4 + 2 + 2) * d)), jnp.bfloat16)
    weights = [jnp.asarray(rng.standard_normal(d), jnp.bfloat16) for _ in range(2)]
    positions = jnp.asarray(rng.integers(0, 2048, tokens), jnp.int32)
    parts = (norm_rope.Part(4, weights[0], 0, heads_axis=True),
             norm_rope.Part(2, weights[1], 2))  # k: block 2 of 2-head width, after 4 q heads
    q, k = norm_rope.norm_rope_parts(wide, parts, positions, THETA, d, EPS, interpret=True)
    want_q = norm_rope.norm_rope(wide[:, :4 * d], weights[0], positions, THETA, 4, EPS,
                                 interpret=True)
    want_k = norm_rope.norm_rope(wide[:, 4 * d:6 * d], weights[1], positions, THETA, 2, EPS,
                                 interpret=True)
    assert q.shape == (tokens, 4, d) and k.shape == (tokens, 2 * d)
    np.testing.assert_array_equal(np.asarray(q.reshape(tokens, 4 * d)), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k))
