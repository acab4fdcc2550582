"""Gated DeltaNet prefill on the engine's flat token layout without padding every row.

``gated_delta.prefill_ragged`` pads each of the step's B rows to the bucket's T tokens: B x T
tokens of delta rule per layer, though the rows hold at most T together (a bucket of 64 short
prompts in 2,048 tokens computes 64 times too much). Here each row's tokens are packed into
whole chunks of C tokens (a row of n tokens takes ceil(n / C) chunks), so a step computes at
most ceil(T / C) + B chunks, one after the other in a scan: a chunk that starts a row takes
that row's initial state, any other continues from the previous chunk's, and the state after
a row's last chunk is its new state.

The conv runs per token: tap j of token i reads the row's input j - (K - 1) positions back, or
the row's conv state when that is before the row's first new token.

Same arguments and results as ``prefill_ragged`` (``max_len`` is not needed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear_attention import delta_rule
from sgl_jax.srt.layers.linear_attention.gated_delta import (
    GatedDeltaDims,
    GatedDeltaParams,
    Parts,
    _heads,
    _output,
)


def _owners(n: int, starts: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per flat token: whether a row owns it, which row (0 if none), its offset in the row."""
    tok = jnp.arange(n)
    inside = (tok[:, None] >= starts[None, :]) & (tok[:, None] < (starts + lengths)[None, :])
    owned, row = jnp.any(inside, axis=1), jnp.argmax(inside, axis=1)
    return owned, row, jnp.where(owned, tok - starts[row], 0)


def _conv(inputs: jax.Array, conv_state: jax.Array, weight: jax.Array, starts: jax.Array,
          lengths: jax.Array, owned: jax.Array, row: jax.Array, offset: jax.Array):
    """One part's silu(causal depthwise conv) per token, and each row's new conv state (the
    K - 1 inputs ending at its last new token, oldest first). ``u = state ++ row inputs``: tap j of the
    token at offset o reads u[o + j]."""
    kernel = weight.shape[1]
    n = inputs.shape[0]

    def u_at(r: jax.Array, pos: jax.Array) -> jax.Array:  # [..., C]: u[pos] of row r
        from_state = conv_state[r, :, jnp.clip(pos, 0, kernel - 2)]
        from_input = inputs[jnp.clip(starts[r] + pos - (kernel - 1), 0, n - 1)]
        return jnp.where((pos < kernel - 1)[..., None], from_state.astype(inputs.dtype),
                         from_input)

    w = weight.astype(jnp.float32)
    conv = sum(w[:, j] * u_at(row, offset + j).astype(jnp.float32) for j in range(kernel))
    mixed = jnp.where(owned[:, None], jax.nn.silu(conv), 0.0)
    b = jnp.arange(conv_state.shape[0])
    new = jnp.stack([u_at(b, lengths + m) for m in range(kernel - 1)], axis=2)  # [B, C, K-1]
    return mixed, new.astype(conv_state.dtype)


def prefill_packed(
    p: GatedDeltaParams, d: GatedDeltaDims, x: jax.Array, starts: jax.Array, lengths: jax.Array,
    conv_state: Parts, recurrent_state: jax.Array, chunk: int = 64,
) -> tuple[jax.Array, Parts, jax.Array]:
    """x [N, hidden] holds B rows' new tokens (row b at starts[b] .. + lengths[b] - 1; tokens
    of no row are ignored and come back as zeros); states [B, ...] are the rows' own. Returns
    (y [N, hidden], conv_state, recurrent_state) after each row's last new token (a row with
    no tokens keeps its states)."""
    n, rows = x.shape[0], starts.shape[0]
    owned, row, offset = _owners(n, starts, lengths)
    parts = [_conv(x @ w.T, state, weight, starts, lengths, owned, row, offset)
             for w, state, weight in zip(p.in_proj_qkv, conv_state, p.conv1d, strict=True)]
    new_conv = tuple(c for _, c in parts)
    q, k, v, g, beta, z = _heads(p, d, x, tuple(m for m, _ in parts))  # [N, Hv, ...]
    g, beta = (jnp.where(owned[:, None], a, 0.0) for a in (g, beta))

    # The packed chunks: row b's start at chunk first[b], ceil(lengths[b] / C) of them.
    num_chunks = -(-n // chunk) + rows  # sum_b ceil(l_b / C) <= N / C + B
    counts = -(-lengths // chunk)
    ends = jnp.cumsum(counts)
    first = ends - counts
    m = jnp.arange(num_chunks)
    chunk_row = jnp.searchsorted(ends, m, side="right")  # B: no row (an unused chunk)
    used = chunk_row < rows
    safe_row = jnp.minimum(chunk_row, rows - 1)
    starts_row = used & (m == first[safe_row])
    last_row = used & (m == ends[safe_row] - 1)
    # Token of packed slot (m, t), and whether it is one.
    pos = (m - first[safe_row])[:, None] * chunk + jnp.arange(chunk)[None, :]  # [M, C]
    real = used[:, None] & (pos < lengths[safe_row][:, None])
    token = jnp.clip(starts[safe_row][:, None] + pos, 0, n - 1)

    def pack(a: jax.Array) -> jax.Array:  # [N, Hv, ...] -> [M, 1, Hv, C, ...]
        packed = jnp.where(real.reshape(*real.shape, *([1] * (a.ndim - 1))), a[token], 0.0)
        return jnp.moveaxis(packed, 1, 2)[:, None]

    init = recurrent_state.astype(jnp.float32)

    def step(carry, xs):
        s, final = carry
        r, begins, ends_row, cq, ck, cv, cg, cb = xs
        s = jnp.where(begins, init[r], s)
        o, s = delta_rule._chunk(s[None], cq, ck, cv, cg, cb)
        final = final.at[r].set(jnp.where(ends_row, s[0], final[r]))
        return (s[0], final), o[0]

    xs = (safe_row, starts_row, last_row, *(pack(a) for a in (q, k, v, g, beta)))
    (_, final), o = jax.lax.scan(step, (jnp.zeros_like(init[0]), init), xs)
    # o [M, Hv, C, dv] -> each token's row: packed slot (first[row] + off // C, off % C).
    o = jnp.moveaxis(o, 2, 1)  # [M, C, Hv, dv]
    o_tok = o[first[row] + offset // chunk, offset % chunk]  # [N, Hv, dv]
    y = _output(p, d, o_tok, z, x.dtype)
    return jnp.where(owned[:, None], y, 0), new_conv, final
