"""The gated delta rule (Qwen3.5's linear attention core), in float32, as pure functions.

Per value head, with state S [dk, dv], for each token t:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) k_t^T S_{t-1})
    o_t = q_t^T S_t

``recurrent_step`` applies it to one token (decode). ``chunked`` computes a whole sequence in
chunks of ``chunk`` tokens: inside a chunk, with G_t the cumulative sum of g from the chunk's
start and S_0 the state entering it, unrolling the recurrence gives

    u = (I + A)^-1 (beta (v - exp(G) K S_0)),   A[t, j] = beta_t exp(G_t - G_j) k_t.k_j  (j < t)
    o_t = exp(G_t) q_t^T S_0 + sum_{j <= t} exp(G_t - G_j) (q_t.k_j) u_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T

(a unit lower-triangular solve per chunk, matmuls otherwise), and a scan carries S between
chunks. A token with g = 0 and beta = 0 leaves the state unchanged (u = 0, no decay): padding
is made of such tokens, so padded positions never disturb a request's state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular


def recurrent_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv] (all
    float32). Returns (o [B, H, dv], new state)."""
    s = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("bhk,bhkv->bhv", k, s)
    u = beta[..., None] * (v - remembered)
    s = s + k[..., :, None] * u[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, s), s


def recurrent(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The token-by-token form over [B, T, H, ...] inputs (a scan of ``recurrent_step``)."""
    def step(s, xs):
        o, s = recurrent_step(*xs, s)
        return s, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def _chunk(s0: jax.Array, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """One chunk of C tokens for one batch of heads: q, k [B, H, C, dk], v [B, H, C, dv],
    g, beta [B, H, C], s0 [B, H, dk, dv]. Returns (o [B, H, C, dv], state after the chunk)."""
    c = q.shape[2]
    big_g = jnp.cumsum(g, axis=-1)  # [B, H, C]
    diff = big_g[..., :, None] - big_g[..., None, :]  # G_t - G_j
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    # exp only where j <= t (diff <= 0 there); above the diagonal diff may overflow exp
    decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    kk = jnp.einsum("bhtd,bhjd->bhtj", k, k)
    strict = jnp.tril(jnp.ones((c, c), dtype=bool), -1)
    a = jnp.where(strict, beta[..., :, None] * decay * kk, 0.0)
    rhs = beta[..., None] * (v - jnp.exp(big_g)[..., None]
                             * jnp.einsum("bhtd,bhdv->bhtv", k, s0))
    eye = jnp.eye(c, dtype=q.dtype)
    u = solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    qk = jnp.einsum("bhtd,bhjd->bhtj", q, k) * decay
    o = (jnp.exp(big_g)[..., None] * jnp.einsum("bhtd,bhdv->bhtv", q, s0)
         + jnp.einsum("bhtj,bhjv->bhtv", qk, u))
    last = big_g[..., -1:]  # G_C
    weights = jnp.exp(last - big_g)  # [B, H, C], <= 1
    s = jnp.exp(last)[..., None] * s0 + jnp.einsum("bhj,bhjd,bhjv->bhdv", weights, k, u)
    return o, s


def chunked(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array,
    chunk: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """The same as ``recurrent`` over q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H]
    (float32), computed chunk by chunk. T is padded to a multiple of ``chunk`` with tokens that
    leave the state unchanged (g = beta = 0). Returns (o [B, T, H, dv], final state)."""
    b, t, h, _ = q.shape
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(a: jax.Array) -> jax.Array:  # [B, T, H, ...] -> [n, B, H, chunk, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    def step(s, xs):
        o, s = _chunk(s, *xs)
        return s, o

    state, out = jax.lax.scan(step, state, tuple(split(a) for a in (q, k, v, g, beta)))
    # out [n, B, H, chunk, dv] -> [B, T, H, dv]
    out = jnp.moveaxis(jnp.moveaxis(out, 3, 2), 0, 1).reshape(b, n * chunk, h, -1)
    return out[:, :t], state
