"""Paged attention in pure JAX, blocked by request (any backend; the CPU default and reference).

The batch's queries are cut into *query blocks*: runs of up to ``q_block`` consecutive tokens
of ONE request (a decode row is a block of one). Every block then reads its request's K/V
from the paged cache, ``kv_block`` positions at a time, through the request's row of the page
table, and merges them with an online softmax. So

- a request's cached prefix is gathered once per block of its queries, not once per query;
- a block attends to its own request only: cost and memory grow with the blocks' tokens times
  the context they read (sum over requests of len_i x context_i, up to the causal half),
  never with the square of the whole batch;
- the batch's own new tokens are read back from the cache too (they were written first), so
  prefix and new tokens are one uniform loop.

The loop runs ``ceil(max context of any block / kv_block)`` times, a traced bound, so long and
short contexts share one compiled program. All blocks advance together (a batched gather per
iteration); a block whose context is shorter than the longest is masked, which costs compute
in a batch that mixes very different lengths but keeps the graph static.

Static sizes: an extend batch of T tokens and B rows has at most ``min(ceil(T / q_block) + B,
T)`` blocks; ``q_block`` is chosen from T / B so the padded query rows stay within ~2x T.
All arithmetic is float32.

Sliding windows (gpt-oss) mask keys more than ``window - 1`` positions before a query, and a
group's loop starts at the first KV block its earliest query still sees: keys outside every
window are never read (a decode step over a long context reads ~``window`` positions).
Attention sinks (gpt-oss) join the softmax after the loop: the running max and denominator
take one more logit per head, whose value is never added to the output.

Multi-head latent attention (``attend_latent``, DeepSeek-V3) is the same loop with one KV
"head" shared by all query heads: the cached latent row is the key of every head and its first
``v_dim`` dims the value, so the output has ``v_dim`` dims per head, not the key's.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.attention.base import MASKED, AttentionBackend, AttentionMetadata

DEFAULT_KV_BLOCK = 128
MAX_QUERY_BLOCK = 64
GROUP_QUERIES = 256  # query positions processed together in an extend batch
SMALL_GROUP_BLOCKS = 16  # group size of the program for batches with few real blocks
# An extend in which no row brings more than this many tokens (a turn appended to a cached
# context, the last prompt token of a cached prompt): query blocks of this size, one per group.
SHORT_EXTEND = 8


def query_block_size(num_tokens: int, num_rows: int, is_decode: bool,
                     is_verify: bool = False) -> int:
    """A power of two near tokens per row, so that blocks x block size stays <= ~2T; in a
    verify step the smallest one that holds a row's tokens (one block per row)."""
    if is_decode:
        return 1
    if is_verify:
        per_row = -(-num_tokens // max(num_rows, 1))
        return 1 << max(per_row - 1, 0).bit_length()
    size = 1
    while size * 2 <= min(MAX_QUERY_BLOCK, max(num_tokens // max(num_rows, 1), 1)):
        size *= 2
    return size


@dataclasses.dataclass
class QueryBlocks:
    row: jax.Array  # [NB] batch row of each block (clamped to a real index)
    first: jax.Array  # [NB] token index of the block's first query
    count: jax.Array  # [NB] queries in the block (0: an unused block)
    first_pos: jax.Array  # [NB] absolute position of the block's first query
    block_of_row: jax.Array  # [B] index of each row's first block


def make_query_blocks(meta: AttentionMetadata, num_tokens: int, q_block: int) -> QueryBlocks:
    batch_size = meta.extend_lens.shape[0]
    blocks_per_row = (meta.extend_lens + q_block - 1) // q_block
    ends = jnp.cumsum(blocks_per_row)
    block_of_row = ends - blocks_per_row
    num_blocks = min(-(-num_tokens // q_block) + batch_size, num_tokens)
    if meta.is_verify:  # one block per row (query_block_size)
        num_blocks = batch_size
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)
    valid = row < batch_size
    row = jnp.minimum(row, batch_size - 1)
    k = j - block_of_row[row]
    count = jnp.where(valid, jnp.clip(meta.extend_lens[row] - k * q_block, 0, q_block), 0)
    return QueryBlocks(
        row=row,
        first=meta.extend_starts[row] + k * q_block,
        count=count,
        first_pos=meta.prefix_lens[row] + k * q_block,
        block_of_row=block_of_row,
    )


class NativeAttention(AttentionBackend):
    name = "native"

    def __init__(self, kv_block: int = DEFAULT_KV_BLOCK, batch_invariant: bool = False) -> None:
        self.kv_block = kv_block
        # --enable-deterministic-inference: every KV block goes through the masked loop body.
        # The unmasked shortcut is chosen per group of query blocks, i.e. by the batch-mates'
        # positions, and its body is compiled separately (its reductions may be fused and
        # ordered differently), so it would make a query's result depend on its group.
        self.batch_invariant = batch_invariant

    def attend(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        return self._attend(q, kv_cache, meta, scale, None, sinks, window)

    def attend_latent(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        v_dim: int,
    ) -> jax.Array:
        if kv_cache.shape[2] != 1 or q.shape[-1] != kv_cache.shape[3] or v_dim > q.shape[-1]:
            raise ValueError(
                f"latent attention needs q [T, H, D] over a cache [P, ps, 1, D] with "
                f"v_dim <= D; got q {q.shape}, cache {kv_cache.shape}, v_dim {v_dim}"
            )
        return self._attend(q, kv_cache, meta, scale, v_dim)

    def _attend(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        v_dim: int | None, sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        """``v_dim`` None: GQA over the combined K/V layout; else latent attention."""
        extra = {"sinks": sinks, "window": window}
        num_tokens = q.shape[0]
        batch_size = meta.extend_lens.shape[0]
        q_block = query_block_size(num_tokens, batch_size, meta.is_decode, meta.is_verify)
        if (meta.is_decode or meta.is_verify or self.batch_invariant
                or q_block <= SHORT_EXTEND):
            return self._attend_blocked(q, kv_cache, meta, scale, v_dim, q_block, **extra)
        # A few new tokens per row over a long cached context would otherwise cost as much as
        # a whole query block per row (q_block rows of queries, mostly padding, each reading
        # the context): with every row <= SHORT_EXTEND tokens, one small block per row, each
        # its own group, reads every context once, as a decode step does (chosen on the
        # device; not in deterministic mode, where a row's program must not depend on its
        # batch-mates).
        return jax.lax.cond(
            jnp.max(meta.extend_lens) <= SHORT_EXTEND,
            lambda: self._attend_blocked(q, kv_cache, meta, scale, v_dim, SHORT_EXTEND, 1,
                                         **extra),
            lambda: self._attend_blocked(q, kv_cache, meta, scale, v_dim, q_block, **extra),
        )

    def _attend_blocked(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        v_dim: int | None, q_block: int, per_group: int | None = None,
        sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        """The attention of every token, its queries cut into blocks of ``q_block`` and
        processed ``per_group`` blocks at a time (None: chosen below)."""
        num_tokens = q.shape[0]
        page_size = kv_cache.shape[1]
        batch_size = meta.extend_lens.shape[0]
        # Whole pages per loop iteration: a block of positions maps to consecutive page columns.
        kv_block = -(-max(self.kv_block, page_size) // page_size) * page_size
        blocks = make_query_blocks(meta, num_tokens, q_block)
        # Blocks are processed GROUP at a time (a decode batch: all rows at once), looping only
        # over the groups that hold real blocks and, per group, only over the KV its blocks
        # need: padding groups cost nothing and the causal half of a long prompt is mostly
        # skipped. Within a group every block advances in lockstep, so a group of mostly
        # padding blocks pays for them all (a one-token extend in a bucket of 64 rows read the
        # whole context for 64 to 256 blocks): when few blocks are real, a second program with
        # small groups runs instead (chosen on the device). Not in deterministic mode, where a
        # request's group size must not depend on its batch-mates.
        num_blocks = blocks.row.shape[0]
        # A decode or verify step: every row at once, as one group.
        full = num_blocks if meta.is_decode or meta.is_verify else max(1, GROUP_QUERIES // q_block)
        small = min(SMALL_GROUP_BLOCKS, full)

        def run(per_group: int) -> jax.Array:
            return self._attend_groups(q, kv_cache, meta, scale, blocks, q_block, kv_block,
                                       per_group, v_dim, sinks, window)[: num_blocks * q_block]

        if per_group is not None:
            out = run(per_group)
        elif small < full and not self.batch_invariant:
            few = jnp.sum(blocks.count > 0) <= small
            out = jax.lax.cond(few, lambda: run(small), lambda: run(full))
        else:
            out = run(full)

        # Back to token order: token t is query (local % qb) of block (first block of its
        # row + local // qb), local being its index among its row's new tokens.
        row_of = meta.token_to_req
        real = row_of < batch_size
        row_c = jnp.minimum(row_of, batch_size - 1)
        local = meta.positions - meta.prefix_lens[row_c]
        where = (blocks.block_of_row[row_c] + local // q_block) * q_block + local % q_block
        return out[jnp.where(real, where, 0)].astype(q.dtype)

    def _attend_groups(
        self, q: jax.Array, kv_cache: jax.Array, meta: AttentionMetadata, scale: float,
        blocks: QueryBlocks, q_block: int, kv_block: int, per_group: int,
        v_dim: int | None = None, sinks: jax.Array | None = None, window: int = 0,
    ) -> jax.Array:
        """Every real query block's attention, ``per_group`` blocks at a time: ``[padded
        blocks * q_block, heads, out_dim]`` float32, block-major. ``v_dim`` None: K and V
        interleaved on the cache's head axis (out_dim = head_dim); else one latent row per
        position, key of every head, its first ``v_dim`` dims the value (out_dim = v_dim)."""
        num_tokens, num_heads, head_dim = q.shape
        _, page_size, combined, _ = kv_cache.shape
        latent = v_dim is not None
        num_kv_heads = 1 if latent else combined // 2
        out_dim = v_dim if latent else head_dim
        group = num_heads // num_kv_heads
        pages_per_block = kv_block // page_size
        num_groups_max = -(-blocks.row.shape[0] // per_group)
        padded = num_groups_max * per_group

        def pad(x: jax.Array) -> jax.Array:
            return jnp.pad(x, (0, padded - x.shape[0]))

        row, first, count, first_pos = map(
            pad, (blocks.row, blocks.first, blocks.count, blocks.first_pos)
        )
        context = jnp.where(count > 0, first_pos + count, 0)  # KV positions each block reads
        num_groups = (jnp.sum(count > 0) + per_group - 1) // per_group
        q32 = q.astype(jnp.float32) * scale
        offs = jnp.arange(q_block, dtype=jnp.int32)
        in_page = jnp.arange(page_size, dtype=jnp.int32)

        def one_group(g: jax.Array, out: jax.Array) -> jax.Array:
            sl = partial(jax.lax.dynamic_slice_in_dim, start_index=g * per_group,
                         slice_size=per_group)
            g_row, g_first, g_pos, g_context = sl(row), sl(first), sl(first_pos), sl(context)
            # Queries of the group: [GB, KVH, G * qb, D]; every contraction keeps its batch
            # dimensions leading (XLA:CPU runs them an order of magnitude faster).
            token = jnp.clip(g_first[:, None] + offs[None, :], 0, num_tokens - 1)
            qg = q32[token].reshape(per_group, q_block, num_kv_heads, group, head_dim)
            qg = qg.transpose(0, 2, 3, 1, 4).reshape(
                per_group, num_kv_heads, group * q_block, head_dim
            )
            q_pos = jnp.tile(g_pos[:, None] + offs[None, :], (1, group))  # [GB, G*qb]
            pages = meta.page_indices[g_row]  # [GB, max_pages]

            def kv_step(i: jax.Array, carry: tuple, causal: bool) -> tuple:
                m, denom, acc = carry
                cols = i * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
                page = jnp.take(pages, cols, axis=1, mode="fill", fill_value=0)  # [GB, ppb]
                kv = kv_cache[page[:, :, None], in_page[None, None, :]]  # [GB, ppb, P, C, D]
                kv = kv.reshape(per_group, kv_block, combined, head_dim).astype(jnp.float32)
                if latent:
                    k = kv.transpose(0, 2, 1, 3)  # [GB, 1, kvb, D]
                    v = k[..., :out_dim]
                else:
                    k = kv[:, :, 0::2].transpose(0, 2, 1, 3)  # [GB, KVH, kvb, D]
                    v = kv[:, :, 1::2].transpose(0, 2, 1, 3)
                s = jnp.einsum("nkxd,nkbd->nkxb", qg, k)
                if causal:  # a block reads only its own request's pages: causal is all
                    kv_pos = i * kv_block + jnp.arange(kv_block, dtype=jnp.int32)
                    visible = kv_pos[None, None, :] <= q_pos[:, :, None]  # [GB, G*qb, kvb]
                    if window:  # and the last `window` keys only, its own included
                        visible &= kv_pos[None, None, :] > q_pos[:, :, None] - window
                    s = jnp.where(visible[:, None], s, MASKED)
                m_new = jnp.maximum(m, s.max(axis=-1))
                correction = jnp.exp(m - m_new)
                p = jnp.exp(s - m_new[..., None])
                denom = denom * correction + p.sum(axis=-1)
                acc = acc * correction[..., None] + jnp.einsum("nkxb,nkbd->nkxd", p, v)
                return m_new, denom, acc

            shape = (per_group, num_kv_heads, group * q_block)
            init = (
                jnp.full(shape, MASKED, jnp.float32),
                jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, out_dim), jnp.float32),
            )
            num_kv_iters = (jnp.max(g_context) + kv_block - 1) // kv_block
            # KV blocks wholly before every block's first query need no mask (most of a long
            # prefix): one elementwise pass fewer over their scores.
            g_count = sl(count)
            unmasked = jnp.min(jnp.where(g_count > 0, g_pos, jnp.iinfo(jnp.int32).max)) // kv_block
            unmasked = jnp.minimum(unmasked, num_kv_iters)
            if self.batch_invariant:
                unmasked = jnp.zeros_like(unmasked)
            start = jnp.zeros_like(unmasked)
            if window:
                # Every block is masked, and blocks before the earliest query's window are
                # never read (skipping leading fully-masked blocks changes no value: the
                # online softmax's correction of exp(MASKED - max) = 0 erases them).
                earliest = jnp.min(jnp.where(g_count > 0, g_pos, jnp.iinfo(jnp.int32).max))
                start = jnp.minimum(jnp.maximum(earliest - window + 1, 0) // kv_block,
                                    num_kv_iters)
                if self.batch_invariant:
                    start = jnp.zeros_like(start)
                unmasked = start
            carry = jax.lax.fori_loop(start, unmasked, partial(kv_step, causal=False), init)
            m, denom, acc = jax.lax.fori_loop(
                unmasked, num_kv_iters, partial(kv_step, causal=True), carry
            )
            if sinks is not None:  # [H]: head h = kv head h // group, member h % group
                sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
                sink = jnp.repeat(sink, q_block, axis=1)[None]  # [1, KVH, G * qb]
                m_all = jnp.maximum(m, sink)
                rescale = jnp.exp(m - m_all)
                denom = denom * rescale + jnp.exp(sink - m_all)
                acc = acc * rescale[..., None]
            res = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
            res = res.reshape(per_group, num_kv_heads, group, q_block, out_dim)
            res = res.transpose(0, 3, 1, 2, 4).reshape(per_group * q_block, num_heads, out_dim)
            return jax.lax.dynamic_update_slice_in_dim(out, res, g * per_group * q_block, axis=0)

        out = jnp.zeros((padded * q_block, num_heads, out_dim), jnp.float32)
        return jax.lax.fori_loop(0, num_groups, one_group, out)

