"""Qwen3.5's Gated DeltaNet in JAX (layers/linear_attention) against the float64 numpy
reference written from the definition (tools/reference_gated_delta): the chunked form, the
token recurrence and the reference agree, across chunk boundaries, when a sequence is split
into calls carrying (conv_state, recurrent_state) (chunked prefill), through one-token decode
steps, and with padded rows (padding leaves the states as the last real token left them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.layers.linear_attention import delta_rule, gated_delta
from sgl_jax.tools.reference_gated_delta import (
    GatedDeltaWeights,
    gated_delta_layer,
    gated_delta_recurrence,
    l2norm,
)

HIDDEN, HK, HV, DK, DV, K = 32, 2, 4, 16, 8, 4
CONV = 2 * HK * DK + HV * DV
DIMS = gated_delta.GatedDeltaDims(HK, HV, DK, DV, 1e-6)
TOL = 2e-5  # float32 against float64, relative to the largest output


def weights(seed: int, a_max: float = 2.0) -> GatedDeltaWeights:
    """Unit-scale projections; A = exp(A_log) in [0.05, a_max] (transformers draws [0.01, 16]:
    a_max=16 tests strong decay, a small one long memory across chunks)."""
    rng = np.random.default_rng(seed)

    def proj(out, inp):
        return rng.standard_normal((out, inp)) / np.sqrt(inp)

    return GatedDeltaWeights(
        in_proj_qkv=proj(CONV, HIDDEN), in_proj_z=proj(HV * DV, HIDDEN),
        in_proj_b=proj(HV, HIDDEN), in_proj_a=proj(HV, HIDDEN),
        conv1d=rng.standard_normal((CONV, K)) / np.sqrt(K), dt_bias=rng.standard_normal(HV),
        A_log=np.log(rng.uniform(0.05, a_max, HV)), norm=1.0 + 0.3 * rng.standard_normal(DV),
        out_proj=proj(HIDDEN, HV * DV), num_key_heads=HK, key_dim=DK, value_dim=DV, eps=1e-6)


def params(w: GatedDeltaWeights) -> gated_delta.GatedDeltaParams:
    """The reference's weights as the JAX layer takes them (q, k, v parts apart)."""
    fields = {f: jnp.asarray(getattr(w, f), jnp.float32)
              for f in gated_delta.GatedDeltaParams._fields}
    for fused in ("in_proj_qkv", "conv1d"):
        fields[fused] = gated_delta.split_qkv(fields[fused], DIMS)
    return gated_delta.GatedDeltaParams(**fields)


def conv_parts(conv: np.ndarray) -> tuple:
    """Reference conv states [B, conv_dim, K-1] as the layer's (q, k, v) parts."""
    return gated_delta.split_qkv(jnp.asarray(conv, jnp.float32), DIMS, axis=1)


def joined(parts) -> np.ndarray:
    """The layer's conv state parts [..., C_part, K-1] as the reference's [..., conv_dim, K-1]."""
    return np.concatenate([np.asarray(a) for a in parts], axis=-2)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def tokens(seed: int, t: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((t, HIDDEN))


@pytest.mark.parametrize("t, chunk", [(150, 64), (64, 64), (37, 16), (5, 64)])
def test_chunked_equals_recurrence_equals_reference(t, chunk):
    rng = np.random.default_rng(t)
    q = l2norm(rng.standard_normal((t, HV, DK))) / np.sqrt(DK)
    k = l2norm(rng.standard_normal((t, HV, DK)))
    v = rng.standard_normal((t, HV, DV))
    g = -rng.uniform(0.0, 0.5, (t, HV))
    beta = rng.uniform(0.0, 1.0, (t, HV))
    s0 = rng.standard_normal((HV, DK, DV))
    want_o, want_s = gated_delta_recurrence(q, k, v, g, beta, s0)
    args = [jnp.asarray(a[None], jnp.float32) for a in (q, k, v, g, beta, s0)]
    o_c, s_c = jax.jit(delta_rule.chunked, static_argnums=6)(*args, chunk)
    o_r, s_r = jax.jit(delta_rule.recurrent)(*args)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        assert rel(o[0], want_o) < TOL and rel(s[0], want_s) < TOL
    assert rel(o_c, o_r) < TOL


@pytest.mark.parametrize("a_max", [2.0, 16.0], ids=["long_memory", "strong_decay"])
def test_prefill_matches_reference_across_chunks(a_max):
    w, x = weights(0, a_max), tokens(0, 150)
    want_y, want_conv, want_s = gated_delta_layer(x, w)
    conv0, s0 = gated_delta.zero_states(DIMS, 1, K)
    fn = jax.jit(gated_delta.prefill, static_argnums=(1, 6))
    y, conv, s = fn(params(w), DIMS, jnp.asarray(x[None], jnp.float32), conv0, s0, None, 64)
    print(f"\nprefill 150 tokens (chunk 64), A<= {a_max}: y rel err {rel(y[0], want_y):.1e}, "
          f"state {rel(s[0], want_s):.1e}")
    assert rel(y[0], want_y) < TOL
    assert rel(joined(conv)[0], want_conv) < 1e-6 and rel(s[0], want_s) < TOL


@pytest.mark.parametrize("split", [70, 64, 1, 149])
def test_split_prefill_then_decode_carries_the_states(split):
    w, x = weights(1), tokens(1, 155)
    want_y, want_conv, want_s = gated_delta_layer(x, w)
    p = params(w)
    fn = jax.jit(gated_delta.prefill, static_argnums=(1, 6))
    conv, s = gated_delta.zero_states(DIMS, 1, K)
    xs = jnp.asarray(x[None], jnp.float32)
    y1, conv, s = fn(p, DIMS, xs[:, :split], conv, s, None, 64)
    y2, conv, s = fn(p, DIMS, xs[:, split:150], conv, s, None, 64)
    ys = [y1[0], y2[0]]
    step = jax.jit(gated_delta.decode, static_argnums=1)
    for i in range(150, 155):  # decode: the one-token recurrence from the carried states
        y, conv, s = step(p, DIMS, xs[:, i], conv, s)
        ys.append(y)
    y = np.concatenate([np.asarray(a) for a in ys])
    err = rel(y, want_y)
    print(f"\nsplit at {split} + 5 decode steps: y rel err {err:.1e}, state "
          f"{rel(s[0], want_s):.1e}")
    assert err < TOL and rel(joined(conv)[0], want_conv) < 1e-6 and rel(s[0], want_s) < TOL


def test_padded_rows_keep_their_states():
    w = weights(2)
    lengths = [40, 13]
    xs = [tokens(2, 40), tokens(3, 13)]
    batch = np.zeros((2, 40, HIDDEN))
    for i, x in enumerate(xs):
        batch[i, : len(x)] = x
    batch[1, 13:] = 9.0  # padding content must not matter
    # nonzero entering states: as after an earlier chunk of the same requests
    prev = [tokens(4, 7), tokens(5, 3)]
    ref_states = [gated_delta_layer(p, w)[1:] for p in prev]
    conv = conv_parts(np.stack([c for c, _ in ref_states]))
    s = jnp.asarray(np.stack([r for _, r in ref_states]), jnp.float32)
    fn = jax.jit(gated_delta.prefill, static_argnums=(1, 6))
    y, conv, s = fn(params(w), DIMS, jnp.asarray(batch, jnp.float32), conv, s,
                    jnp.asarray(lengths, jnp.int32), 16)
    for i, x in enumerate(xs):
        want_y, want_conv, want_s = gated_delta_layer(x, w, *ref_states[i])
        assert rel(y[i, : lengths[i]], want_y) < TOL
        assert rel(joined(conv)[i], want_conv) < 1e-6 and rel(s[i], want_s) < TOL


def test_ragged_prefill_on_the_flat_token_layout():
    """Three requests' new tokens packed in one flat step (with bucket padding at the end and
    an empty request), each continuing from its own states, as the engine's step lays them."""
    w = weights(3)
    prev = [tokens(6, 5), tokens(7, 1), tokens(8, 9)]
    new = [tokens(9, 70), tokens(10, 0), tokens(11, 23)]
    states = [gated_delta_layer(p, w)[1:] for p in prev]
    lengths = [len(x) for x in new]
    starts = np.cumsum([0] + lengths[:-1])
    flat = np.concatenate(new + [np.full((7, HIDDEN), 5.0)])  # 7 padding rows
    fn = jax.jit(gated_delta.prefill_ragged, static_argnums=(1, 7, 8))
    y, conv, s = fn(params(w), DIMS, jnp.asarray(flat, jnp.float32),
                    jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32),
                    conv_parts(np.stack([c for c, _ in states])),
                    jnp.asarray(np.stack([r for _, r in states]), jnp.float32), 80, 32)
    for b, x in enumerate(new):
        want_y, want_conv, want_s = gated_delta_layer(x, w, *states[b])
        if len(x):
            assert rel(y[starts[b]: starts[b] + len(x)], want_y) < TOL
        assert rel(joined(conv)[b], want_conv) < 1e-6 and rel(s[b], want_s) < TOL
    assert not np.asarray(y[sum(lengths):]).any()


def test_bfloat16_params_keep_a_float32_core():
    """bf16 weights and activations (the served dtype): the states stay float32 and the output
    is the reference's within bf16 rounding."""
    w, x = weights(4), tokens(4, 90)
    want_y, _, want_s = gated_delta_layer(x, w)
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params(w))
    conv, s = gated_delta.zero_states(DIMS, 1, K, jnp.bfloat16)
    xs = jnp.asarray(x[None], jnp.bfloat16)
    y1, conv, s = jax.jit(gated_delta.prefill, static_argnums=(1, 6))(
        p, DIMS, xs[:, :89], conv, s, None, 64)
    y2, conv, s = jax.jit(gated_delta.decode, static_argnums=1)(p, DIMS, xs[:, 89], conv, s)
    assert s.dtype == jnp.float32 and y2.dtype == jnp.bfloat16
    assert all(part.dtype == jnp.bfloat16 for part in conv)
    y = np.concatenate([np.asarray(y1[0], np.float64), np.asarray(y2, np.float64)])
    assert rel(y, want_y) < 5e-2 and rel(s[0], want_s) < 5e-2
