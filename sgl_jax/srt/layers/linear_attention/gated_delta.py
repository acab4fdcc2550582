"""Qwen3.5's Gated DeltaNet layer as pure functions of (params, inputs, states).

The engine carries two states per request and layer (zeros for a new request):

* ``conv_state``: the last K-1 inputs of the causal depthwise conv, oldest first, per part of
  its channels (:data:`Parts`: q ``[B, Hk dk, K-1]``, k likewise, v ``[B, Hv dv, K-1]``);
* ``recurrent_state`` [B, Hv, dk, dv] float32: the delta rule's state S.

``prefill`` runs T tokens per row (rows padded to T; ``lengths`` gives each row's real tokens;
padded tokens leave both states as the last real token left them) in the chunked form;
``decode`` runs one token per row with the recurrence. Either continues from the states it is
given, so a prompt split into chunks (chunked prefill) gives the same outputs and states as
one call. The projections run in the params' dtype; the conv output, q/k L2 norms, g, beta,
the delta rule and the gated output norm in float32 (as transformers does whatever the
model dtype).

The q, k and v channels (transformers' one ``in_proj_qkv`` and ``conv1d``, rows ``[q | k | v]``)
are kept as three parts end to end: each splits by head over the "tensor" mesh axis
(``models/gated_deltanet.py``), which one concatenated axis would not. ``split_qkv`` cuts a
concatenated tensor into them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear_attention import delta_rule

L2_EPS = 1e-6  # of the q and k L2 norms (fixed by the definition, not a config field)

Parts = tuple[jax.Array, jax.Array, jax.Array]  # (q, k, v) channel parts, channels on axis 0 or 1


class GatedDeltaParams(NamedTuple):
    """One layer's weights, projections in transformers' [out, in] orientation."""

    in_proj_qkv: Parts  # q [Hk dk, hidden], k [Hk dk, hidden], v [Hv dv, hidden]
    in_proj_z: jax.Array  # [Hv dv, hidden]
    in_proj_b: jax.Array  # [Hv, hidden]
    in_proj_a: jax.Array  # [Hv, hidden]
    conv1d: Parts  # q [Hk dk, K], k [Hk dk, K], v [Hv dv, K] (transformers': [conv_dim, 1, K])
    dt_bias: jax.Array  # [Hv]
    A_log: jax.Array  # [Hv]
    norm: jax.Array  # [dv]
    out_proj: jax.Array  # [hidden, Hv dv]


class GatedDeltaDims(NamedTuple):
    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    eps: float  # of the gated output RMSNorm (rms_norm_eps)


def part_widths(d: GatedDeltaDims) -> tuple[int, int, int]:
    """Channels of the q, k and v parts (their sum is the conv's width)."""
    qk = d.num_key_heads * d.key_dim
    return qk, qk, d.num_value_heads * d.value_dim


def state_shapes(d: GatedDeltaDims, kernel: int) -> tuple[tuple, tuple]:
    """One request's state shapes: (the conv state parts' ``(C_part, K - 1)``, the recurrent
    state's ``(Hv, dk, dv)``)."""
    return (tuple((c, kernel - 1) for c in part_widths(d)),
            (d.num_value_heads, d.key_dim, d.value_dim))


def split_qkv(fused, d: GatedDeltaDims, axis: int = 0) -> tuple:
    """A tensor (numpy or JAX) over the concatenated ``[q | k | v]`` channels on ``axis`` as its
    three parts."""
    qk = part_widths(d)[0]
    lead = (slice(None),) * axis
    return tuple(fused[(*lead, slice(a, b))] for a, b in ((0, qk), (qk, 2 * qk), (2 * qk, None)))


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _heads(p: GatedDeltaParams, d: GatedDeltaDims, x: jax.Array, mixed: Parts):
    """q, k (normalised, q scaled, key heads repeated to the value heads), v, g, beta and z for
    tokens x [..., hidden] whose conv output is ``mixed`` (q, k, v parts [..., channels],
    float32)."""
    hk, hv, dk, dv = d.num_key_heads, d.num_value_heads, d.key_dim, d.value_dim
    lead = x.shape[:-1]
    q = mixed[0].reshape(*lead, hk, dk)
    k = mixed[1].reshape(*lead, hk, dk)
    v = mixed[2].reshape(*lead, hv, dv)
    # value head h reads key head h // (Hv / Hk) (so a device's value heads read its key heads)
    q = jnp.repeat(_l2norm(q), hv // hk, axis=-2) * (dk ** -0.5)
    k = jnp.repeat(_l2norm(k), hv // hk, axis=-2)
    beta = jax.nn.sigmoid((x @ p.in_proj_b.T).astype(jnp.float32))
    a = (x @ p.in_proj_a.T).astype(jnp.float32)
    g = -jnp.exp(p.A_log.astype(jnp.float32)) * jax.nn.softplus(a + p.dt_bias.astype(jnp.float32))
    z = (x @ p.in_proj_z.T).reshape(*lead, hv, dv)
    return q, k, v, g, beta, z


def _output(p: GatedDeltaParams, d: GatedDeltaDims, o: jax.Array, z: jax.Array, dtype):
    """out_proj(rmsnorm(o) * norm.weight * silu(z)), the norm per value head in float32."""
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + d.eps)
    gated = normed * p.norm.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return gated.reshape(*o.shape[:-2], -1).astype(dtype) @ p.out_proj.T


def _conv_padded(inputs: jax.Array, state: jax.Array, weight: jax.Array, lengths: jax.Array):
    """One part's silu(causal depthwise conv) over rows padded to T tokens: inputs [B, T, C],
    state [B, C, K-1]; and its new state (the K-1 inputs ending at each row's last real token)."""
    t, kernel = inputs.shape[1], weight.shape[1]
    u = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(inputs.dtype), inputs], axis=1)
    w = weight.astype(jnp.float32)
    mixed = jax.nn.silu(sum(w[:, j] * u[:, j: j + t].astype(jnp.float32) for j in range(kernel)))
    new = jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, kernel - 1))(u, lengths)
    return mixed, jnp.swapaxes(new, 1, 2).astype(state.dtype)


def prefill(
    p: GatedDeltaParams, d: GatedDeltaDims, x: jax.Array, conv_state: Parts,
    recurrent_state: jax.Array, lengths: jax.Array | None = None, chunk: int = 64,
) -> tuple[jax.Array, Parts, jax.Array]:
    """x [B, T, hidden] (after the input norm) from the given states. ``lengths`` [B] (default
    T): real tokens per row, the rest padding. Returns (y [B, T, hidden] (padding rows
    arbitrary), conv_state, recurrent_state) after each row's last real token."""
    b, t, _ = x.shape
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)
    parts = [_conv_padded(x @ w.T, s, cw, lengths)
             for w, s, cw in zip(p.in_proj_qkv, conv_state, p.conv1d, strict=True)]
    mixed, new_conv = tuple(m for m, _ in parts), tuple(c for _, c in parts)
    q, k, v, g, beta, z = _heads(p, d, x, mixed)
    real = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
    g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)  # padding: state unchanged
    o, state = delta_rule.chunked(q, k, v, g, beta, recurrent_state.astype(jnp.float32), chunk)
    return _output(p, d, o, z, x.dtype), new_conv, state


def decode(
    p: GatedDeltaParams, d: GatedDeltaDims, x: jax.Array, conv_state: Parts,
    recurrent_state: jax.Array,
) -> tuple[jax.Array, Parts, jax.Array]:
    """One token per row: x [B, hidden]. Returns (y [B, hidden], conv_state, recurrent_state);
    O(1) in the context length."""
    mixed, new_conv = [], []
    for w, state, weight in zip(p.in_proj_qkv, conv_state, p.conv1d, strict=True):
        inputs = x @ w.T  # [B, C]
        u = jnp.concatenate([state.astype(inputs.dtype), inputs[:, :, None]], axis=2)  # [B,C,K]
        mixed.append(jax.nn.silu(jnp.sum(u.astype(jnp.float32) * weight.astype(jnp.float32),
                                         axis=2)))
        new_conv.append(u[:, :, 1:].astype(state.dtype))
    q, k, v, g, beta, z = _heads(p, d, x, tuple(mixed))
    o, state = delta_rule.recurrent_step(q, k, v, g, beta, recurrent_state.astype(jnp.float32))
    return _output(p, d, o, z, x.dtype), tuple(new_conv), state


def zero_states(d: GatedDeltaDims, batch: int, kernel: int, dtype=jnp.float32
                ) -> tuple[Parts, jax.Array]:
    """A new request's states: (conv_state parts, recurrent_state [B, Hv, dk, dv])."""
    conv, recurrent = state_shapes(d, kernel)
    return (tuple(jnp.zeros((batch, *c), dtype) for c in conv),
            jnp.zeros((batch, *recurrent), jnp.float32))


def prefill_ragged(
    p: GatedDeltaParams, d: GatedDeltaDims, x: jax.Array, starts: jax.Array, lengths: jax.Array,
    conv_state: Parts, recurrent_state: jax.Array, max_len: int, chunk: int = 64,
) -> tuple[jax.Array, Parts, jax.Array]:
    """``prefill`` on the engine's flat token layout: x [N, hidden] holds B requests' new
    tokens, request b at rows starts[b] .. starts[b] + lengths[b] - 1 (rows of no request, e.g.
    bucket padding, are ignored and come back as zeros); states [B, ...] are the requests'
    (gathered from their state slots). ``max_len`` (static) bounds every lengths[b]; a row
    with lengths[b] = 0 keeps its states. Returns (y [N, hidden], conv_state, recurrent_state)."""
    n = x.shape[0]
    cols = jnp.arange(max_len)
    rows = jnp.clip(starts[:, None] + cols[None, :], 0, n - 1)  # [B, max_len]
    padded = jnp.where((cols[None, :] < lengths[:, None])[..., None], x[rows], 0)
    y, conv_state, recurrent_state = prefill(p, d, padded, conv_state, recurrent_state,
                                             lengths, chunk)
    # back to the flat rows: token i of request b -> row starts[b] + i
    tok = jnp.arange(n)
    inside = (tok[:, None] >= starts[None, :]) & (tok[:, None] < (starts + lengths)[None, :])
    owner, req = jnp.any(inside, axis=1), jnp.argmax(inside, axis=1)  # [N]
    flat = y[req, jnp.clip(tok - starts[req], 0, max_len - 1)]
    return jnp.where(owner[:, None], flat, 0), conv_state, recurrent_state
