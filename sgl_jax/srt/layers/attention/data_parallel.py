"""Data-parallel attention (``--enable-dp-attention``): each rank attends over its own rows
with its own shard of the KV cache.

The ranks are the rows of the "expert" mesh axis. A DP batch is laid out rank by rank
(``forward_batch_info.build_dp_forward_batch``): rank r holds rows ``[r * b, (r + 1) * b)``
and tokens ``[r * t, (r + 1) * t)``, and every KV slot its tokens read or write lies in its
own contiguous range of pages (its allocator's, ``memory_pool.TokenToKVPoolAllocator``
``first_page``), which is exactly rank r's shard of a cache split over "expert" on the page
axis. So inside ``shard_map`` a rank turns global rows, token indices, pages and slots into
local ones by a subtraction and runs the ordinary backend on its shard: no KV byte and no
query crosses a rank. Within a rank the heads stay split over "tensor" as without DP (when
the KV heads are; MLA's single latent row is replicated over "tensor", its query heads are
split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.attention.base import AttentionMetadata

DATA_AXIS = "expert"  # the attention ranks (DP attention's "data" axis)
TENSOR_AXIS = "tensor"

# body(q, new_rows, kv_cache, slots, meta) -> (attention output, new kv_cache)
AttentionBody = Callable[[jax.Array, Any, jax.Array, jax.Array, AttentionMetadata],
                         tuple[jax.Array, jax.Array]]


def _localise(meta: AttentionMetadata, num_tokens: int, num_pages: int) -> AttentionMetadata:
    """A rank's view of the step's metadata: its rows, tokens and pages counted from 0."""
    rank = jax.lax.axis_index(DATA_AXIS)
    rows = meta.prefix_lens.shape[0]
    return dataclasses.replace(
        meta,
        # Padded tokens point past the whole batch; locally, past the rank's rows.
        token_to_req=jnp.minimum(meta.token_to_req - rank * rows, rows),
        extend_starts=meta.extend_starts - rank * num_tokens,
        # Padding rows' pages belong to no rank (never read): clamp them into range.
        page_indices=jnp.clip(meta.page_indices - rank * num_pages, 0, num_pages - 1),
    )


def rank_local_attention(
    body: AttentionBody, q: jax.Array, new_rows: Any, kv_cache: jax.Array, slots: jax.Array,
    meta: AttentionMetadata, heads_split: bool, cache_heads_split: bool,
) -> tuple[jax.Array, jax.Array]:
    """Runs ``body`` (write the new rows, then attend) per attention rank.

    q ``[T, H, D]`` (or a tuple of it and ``[T, H]`` per-head extras: gpt-oss's sinks, split
    like the heads); ``new_rows`` a pytree of ``[T, ...]`` arrays the body writes (GQA's K
    and V ``[T, KVH, D]``, MLA's latent rows ``[T, D]``); ``kv_cache`` ``[pages, page_size,
    heads, D]``; ``slots`` [T] the tokens' global KV slots. ``heads_split``: the query heads
    are split over "tensor" within a rank; ``cache_heads_split``: so are the cache's heads
    (and the new rows' heads). Without a mesh in context, ``body`` runs as is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in mesh.axis_names:
        return body(q, new_rows, kv_cache, slots, meta)
    head = TENSOR_AXIS if heads_split else None
    cache_head = TENSOR_AXIS if cache_heads_split else None
    rows_spec = jax.tree.map(
        lambda x: P(DATA_AXIS, cache_head) if x.ndim == 3 else P(DATA_AXIS), new_rows)
    cache_spec = P(DATA_AXIS, None, cache_head)

    def per_rank(q: jax.Array, new_rows: Any, kv_cache: jax.Array, slots: jax.Array,
                 meta: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        num_pages, page_size = kv_cache.shape[:2]
        first_slot = jax.lax.axis_index(DATA_AXIS) * num_pages * page_size
        tokens = jax.tree.leaves(q)[0].shape[0]  # q may carry per-query extras (sinks)
        return body(q, new_rows, kv_cache, slots - first_slot,
                    _localise(meta, tokens, num_pages))

    run = jax.shard_map(
        per_rank, mesh=mesh,
        in_specs=(P(DATA_AXIS, head), rows_spec, cache_spec, P(DATA_AXIS),
                  jax.tree.map(lambda _: P(DATA_AXIS), meta)),
        out_specs=(P(DATA_AXIS, head), cache_spec),
        # The backends' loops start from constants (not varying over the mesh) and carry
        # per-rank values: their types differ only in that bookkeeping, not in layout.
        check_vma=False,
    )
    return run(q, new_rows, kv_cache, slots, meta)


def take_rank_rows(h: jax.Array, indices: jax.Array, dp_size: int) -> jax.Array:
    """``h[indices]`` for a DP batch whose row i's index lies in row i's rank's tokens (each
    row's last token: ``ForwardBatch.logits_indices``): a gather per rank, so every rank
    picks its own rows and the LM head runs on them alone, not on the whole batch's rows
    replicated over the ranks. h ``[T, H]``, indices ``[B]`` -> ``[B, H]``."""
    tokens, rows = h.shape[0] // dp_size, indices.shape[0] // dp_size
    first = jnp.arange(dp_size, dtype=indices.dtype)[:, None] * tokens
    # A rank whose rows are all padding points at the previous rank's last token: clamp.
    local = jnp.clip(indices.reshape(dp_size, rows) - first, 0, tokens - 1)
    picked = jnp.take_along_axis(h.reshape(dp_size, tokens, -1), local[:, :, None], axis=1)
    return picked.reshape(dp_size * rows, -1)
