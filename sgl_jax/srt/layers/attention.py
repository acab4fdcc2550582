"""Paged attention in pure JAX (runs on any backend, CPU included).

A batch's queries attend to two sets of keys, merged with one online softmax:
- the request's cached prefix, read from the KV cache through its page-table row in blocks of
  ``block_size`` positions; the loop runs ``ceil(max(prefix_lens) / block_size)`` times, a
  traced bound, so long and short contexts share one compiled program and an extend batch
  without cached prefix does no gather at all;
- the batch's own new tokens (same request, earlier or equal position), taken straight from
  the freshly projected K/V rather than from the cache.
Decode is the special case of one new token per request. All arithmetic is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.model_executor.forward_batch import ForwardBatch

# Finite "minus infinity": a fully masked row then gives weights of exactly 0, never NaN.
_MASKED = -1e30
DEFAULT_BLOCK_SIZE = 128
FINE_BLOCK_SIZE = 16  # the tail of a prefix is read in blocks of this many positions


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V rows to their slots (padding tokens all write the reserved slot 0)."""
    return (
        k_cache.at[slots].set(k.astype(k_cache.dtype)),
        v_cache.at[slots].set(v.astype(v_cache.dtype)),
    )


def paged_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    batch: ForwardBatch,
    scale: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
    """q: [T, H, D]; k_new, v_new: [T, KVH, D]; caches: [slots, KVH, D]. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    # Every contraction below keeps its batch dimensions leading ([KVH, ...] or [T, KVH, ...]):
    # XLA:CPU runs einsums with a batch dimension in the middle an order of magnitude slower.
    q32 = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * scale
    req = batch.token_to_req
    pos = batch.positions

    # Keys of this batch's own tokens: same request, not after the query (causal).
    qh = q32.transpose(1, 2, 0, 3).reshape(num_kv_heads, group * num_tokens, head_dim)
    kh = k_new.astype(jnp.float32).transpose(1, 0, 2)  # [KVH, T, D]
    vh = v_new.astype(jnp.float32).transpose(1, 0, 2)
    scores = jnp.einsum("kxd,ksd->kxs", qh, kh).reshape(
        num_kv_heads, group, num_tokens, num_tokens
    )
    visible = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None])
    scores = jnp.where(visible[None, None], scores, _MASKED)
    m = scores.max(axis=-1)  # [KVH, G, T]
    p = jnp.exp(scores - m[..., None])
    denom = p.sum(axis=-1)
    acc = jnp.einsum("kxs,ksd->kxd", p.reshape(num_kv_heads, group * num_tokens, num_tokens), vh)
    # To the per-token layout of the prefix loop: [T, KVH, G, (D)].
    m = m.transpose(2, 0, 1)
    denom = denom.transpose(2, 0, 1)
    acc = acc.reshape(num_kv_heads, group, num_tokens, head_dim).transpose(2, 0, 1, 3)

    # Keys of the cached prefix, block by block through the page table: whole blocks first,
    # then the remainder in small blocks, so a short prefix (a chunk boundary, a 1-token
    # prefix-cache hit) costs every query of the batch a few positions, not a whole block.
    prefix_len = jnp.take(batch.prefix_lens, req, mode="fill", fill_value=0)  # [T]
    longest = jnp.max(batch.prefix_lens)
    # Decode has one query per request, so a wide gather is cheap and fewer loop iterations
    # (each a fixed cost per layer) win; an extend batch gathers per query token.
    fine = block_size if batch.forward_mode.is_decode else min(block_size, FINE_BLOCK_SIZE)

    def prefix_block(start: jax.Array, size: int, carry: tuple) -> tuple:
        m, denom, acc = carry
        rows = jax.lax.dynamic_slice_in_dim(batch.page_table, start, size, axis=1)
        slots = jnp.take(rows, req, axis=0, mode="fill", fill_value=0)  # [T, size]
        kb = k_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)  # [T, KVH, size, D]
        vb = v_cache[slots].astype(jnp.float32).transpose(0, 2, 1, 3)
        s = jnp.einsum("tkgd,tkbd->tkgb", q32, kb)
        cols = start + jnp.arange(size)
        s = jnp.where((cols[None, :] < prefix_len[:, None])[:, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        denom = denom * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("tkgb,tkbd->tkgd", p, vb)
        return m_new, denom, acc

    num_blocks = longest // block_size
    carry = jax.lax.fori_loop(
        0, num_blocks, lambda i, c: prefix_block(i * block_size, block_size, c), (m, denom, acc)
    )
    done = num_blocks * block_size
    num_fine = (longest - done + fine - 1) // fine
    m, denom, acc = jax.lax.fori_loop(
        0, num_fine, lambda i, c: prefix_block(done + i * fine, fine, c), carry
    )
    out = acc / denom[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
