"""``packed.prefill_packed`` (each row's tokens packed into whole chunks, no row padded to the
bucket) against the float64 reference layer (tools/reference_gated_delta), on the engine's flat
token layout: rows continuing from their own states, an empty row, rows longer than a chunk,
a row ending exactly on a chunk boundary, bucket padding at the end; and equal to
``gated_delta.prefill_ragged`` (the padded form) on the same inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.layers.linear_attention import gated_delta
from sgl_jax.srt.layers.linear_attention.packed import prefill_packed
from sgl_jax.tools.reference_gated_delta import gated_delta_layer
from tests.test_gated_delta import (
    DIMS,
    HIDDEN,
    TOL,
    conv_parts,
    joined,
    params,
    rel,
    tokens,
    weights,
)


@pytest.mark.parametrize("chunk, new_lengths", [(16, (70, 0, 23, 16, 1)), (64, (5, 64, 0))])
def test_packed_prefill_matches_reference_and_padded_form(chunk, new_lengths):
    w = weights(4)
    prev = [tokens(20 + b, 3 + 2 * b) for b in range(len(new_lengths))]
    new = [tokens(40 + b, n) for b, n in enumerate(new_lengths)]
    states = [gated_delta_layer(p, w)[1:] for p in prev]
    lengths = np.asarray(new_lengths, np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    flat = np.concatenate(new + [np.full((9, HIDDEN), 3.0)])  # 9 padding tokens
    conv0 = conv_parts(np.stack([c for c, _ in states]))
    rec0 = jnp.asarray(np.stack([r for _, r in states]), jnp.float32)
    args = (jnp.asarray(flat, jnp.float32), jnp.asarray(starts), jnp.asarray(lengths))
    packed = jax.jit(prefill_packed, static_argnums=(1, 7))
    y, conv, s = packed(params(w), DIMS, *args, conv0, rec0, chunk)
    for b, x in enumerate(new):
        want_y, want_conv, want_s = gated_delta_layer(x, w, *states[b])
        if len(x):
            assert rel(y[starts[b]: starts[b] + len(x)], want_y) < TOL
        assert rel(joined(conv)[b], want_conv) < 1e-6 and rel(s[b], want_s) < TOL
    assert not np.asarray(y[int(lengths.sum()):]).any()
    ragged = jax.jit(gated_delta.prefill_ragged, static_argnums=(1, 7, 8))
    y2, conv2, s2 = ragged(params(w), DIMS, *args, conv0, rec0, flat.shape[0], chunk)
    assert rel(y, y2) < TOL and rel(joined(conv), joined(conv2)) < 1e-6 and rel(s, s2) < TOL
