"""Device-side token sampler: pure and jittable, traced inside the model's jitted forward.

Semantics for one row (one request) with logits ``x`` over a vocabulary of ``V`` ids:

- greedy (temperature < SAMPLING_EPS): ``argmax(x)``, ties to the lower id.
- otherwise ``p = softmax(x / temperature)`` and the support is the intersection of
    * top-k:  the ``k`` most probable ids (``k >= V`` or ``k <= 0``: all of them),
    * top-p:  the shortest most-probable-first prefix whose cumulative ``p`` is >= top_p
              (``top_p >= 1``: all ids),
    * min-p:  ids with ``p >= min_p * max(p)``,
    * ids with ``p > 0`` (so a ``-inf`` logit is never picked),
  each computed on the *unrenormalised* ``p`` (SGLang's convention; with it the filters
  commute). Equal ``p`` are ordered lower id first. The token is drawn from ``p`` renormalised
  over the support.

Every set above is a prefix of the ids sorted by (descending ``p``, ascending id), so the support
is the prefix of length ``min(k, L_top_p, L_min_p, L_nonzero)``: counts over one sorted row,
no data-dependent shapes. The sort is avoided whenever it provably is not needed (see
``sample``): XLA's sort of a 150k vocabulary costs ~50 ms per row on CPU, and on TPU the
sort-based ``top_k`` and a cumulative sum across the vocabulary's shards dominate the
sampler's bytes. So the vocabulary is cut into a few equal chunks (``chunk_count``; they line
up with the LM head's shards when the tensor-parallel size divides the count):

- the head is a top-k per chunk, then a top-k of the chunks' heads (``chunked_top_k``: the
  same values and ids, ties still to the lower id, with no sort of the whole row);
- cumulative sums run within chunks, then add the totals of the chunks before
  (``chunked_cumsum``: no gather of the sharded row); the untruncated rows' inverse CDF over
  the whole vocabulary sums every chunk but runs a cumulative sum over only the chunk the
  draw lands in (``chunked_inverse_cdf``);
- the full-sort fallback sorts only the rows that need it, ``FALLBACK_ROWS`` at a time (on
  every platform).

The chunks are for TPU only (``vocab_chunks_for``): XLA:CPU's TopK of a whole row is a fast
custom call and of a chunked row a sort (7x slower measured at 8 x 151,936), and its cumsum
fuses with the exponential only over whole rows (the sampler 1.3x slower chunked).

The draw is an inverse CDF with one uniform per row from ``fold_in(key(seed), step)``. The token
depends only on (seed, step, logits row, sampling params), never on the batch row, the batch
size, the padding or the batch-mates, so seeded requests reproduce under continuous batching.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.sampling.sampling_metadata import SamplingMetadata
from sgl_jax.srt.sampling.sampling_params import SAMPLING_EPS

_PRNG_IMPL = "threefry2x32"  # fixed, so streams do not change with jax_default_prng_impl
TPU_VOCAB_CHUNKS = 16  # the most vocabulary chunks on TPU (``vocab_chunks_for``)
# Rows the full-sort fallback sorts per pass: a pass's cost is this many rows' sort, whatever
# the batch; rows needing the sort are rare (a support wider than the 1024-id head).
FALLBACK_ROWS = 8


def chunk_count(width: int, most: int, min_chunk: int = 1) -> int:
    """How many equal chunks a row of ``width`` ids is cut into: the largest power of two up
    to ``most`` that divides it into chunks of at least ``min_chunk`` ids, else 1."""
    chunks = 1 << (max(most, 1).bit_length() - 1)
    while chunks > 1 and (width % chunks or width // chunks < min_chunk):
        chunks //= 2
    return chunks


def vocab_chunks_for(platform: str) -> int:
    """``sample``'s ``vocab_chunks`` for programs compiled for ``platform``."""
    return TPU_VOCAB_CHUNKS if platform.lower() == "tpu" else 1


def chunked_top_k(x: jax.Array, k: int, most: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` of [B, V] rows, exactly (values, ids, ties to the lower id),
    from a top-k per chunk and a top-k of their ``chunks * k`` candidates: every row's top k
    lie in the union of its chunks' top k. The candidates are laid out chunk by chunk, each
    in rank order, so among equal values the lower position is the lower id. At most
    ``most`` chunks of at least k ids (1: ``lax.top_k`` of the whole row)."""
    batch, width = x.shape
    chunks = chunk_count(width, most, k)
    if chunks == 1:
        return jax.lax.top_k(x, k)
    size = width // chunks
    vals, ids = jax.lax.top_k(x.reshape(batch, chunks, size), k)  # [B, chunks, k]
    ids = ids + (jnp.arange(chunks, dtype=ids.dtype) * size)[None, :, None]
    vals, pos = jax.lax.top_k(vals.reshape(batch, chunks * k), k)
    return vals, jnp.take_along_axis(ids.reshape(batch, chunks * k), pos, axis=1)


def chunked_cumsum(x: jax.Array, most: int) -> jax.Array:
    """Inclusive cumulative sum along [B, V] rows: within each of at most ``most`` chunks,
    plus the totals of the chunks before it (the same sums up to float rounding order, which
    XLA does not fix for ``cumsum`` either; 1: ``cumsum`` of the whole row)."""
    batch, width = x.shape
    chunks = chunk_count(width, most)
    if chunks == 1:
        return jnp.cumsum(x, axis=1)
    parts = jnp.cumsum(x.reshape(batch, chunks, width // chunks), axis=2)
    totals = parts[:, :, -1]
    before = jnp.cumsum(totals, axis=1) - totals  # [B, chunks]: mass of the chunks before
    return (parts + before[:, :, None]).reshape(batch, width)


def chunked_inverse_cdf(weights: jax.Array, u: jax.Array, most: int
                        ) -> tuple[jax.Array, jax.Array]:
    """``_inverse_cdf`` over whole [B, V] rows of ``weights`` (eligible: weight > 0) and the
    rows' total weight, with a cumulative sum over one chunk per row only (of at most
    ``most``): the chunks' totals and their running sum pick the chunk the draw lands in (the
    first whose running total passes ``u * total`` and that holds an eligible id, else the
    last that holds one), then that chunk's cumulative sum (plus the mass before it) picks
    the id; no eligible id in it past the draw (float rounding of the two sums): its last
    eligible id. Never an ineligible id; the token differs from the whole-row cumsum's only
    where the draw lands within float rounding of a cumulative sum (as ``chunked_cumsum``)."""
    batch, width = weights.shape
    chunks = chunk_count(width, most)
    size = width // chunks
    w3 = weights.reshape(batch, chunks, size)
    totals = jnp.sum(w3, axis=2)  # [B, C]
    upto = jnp.cumsum(totals, axis=1)  # running total through each chunk
    total = upto[:, -1]
    threshold = u * total
    any_eligible = jnp.any(w3 > 0.0, axis=2)  # [B, C]
    passes = any_eligible & (upto > threshold[:, None])
    last_chunk = chunks - 1 - jnp.argmax(any_eligible[:, ::-1], axis=1)
    chunk = jnp.where(jnp.any(passes, axis=1), jnp.argmax(passes, axis=1), last_chunk)
    # The chosen chunk's weights (one nonzero term per sum: exact; no gather across the
    # vocabulary's shards).
    pick = jnp.arange(chunks)[None, :, None] == chunk[:, None, None]
    w = jnp.sum(jnp.where(pick, w3, 0.0), axis=1)  # [B, size]
    before = jnp.take_along_axis(upto - totals, chunk[:, None], axis=1)  # [B, 1]
    pos = _inverse_cdf(jnp.cumsum(w, axis=1) + before, w > 0.0, threshold, jnp.ones_like(u))
    return (chunk * size + pos).astype(jnp.int32), total


def apply_vocab_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``logits`` [B, V] with every id whose bit is clear in the packed ``mask`` [B, W]
    (int32, W >= ceil(V / 32); bit ``i % 32`` of word ``i // 32`` is id ``i``) set to -inf.
    The mask is unpacked on the device (B * W words cross from the host, not B * V flags)."""
    batch, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (mask.astype(jnp.uint32)[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(batch, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _row_uniforms(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """[B] float32 in [0, 1): one draw per row from fold_in(key(seed), step)."""

    def one(seed_words: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.wrap_key_data(seed_words.astype(jnp.uint32), impl=_PRNG_IMPL)
        key = jax.random.fold_in(key, step.astype(jnp.uint32))
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(seeds, steps)


def _inverse_cdf(
    cum: jax.Array, eligible: jax.Array, mass: jax.Array, u: jax.Array
) -> jax.Array:
    """[B] positions: the first eligible position whose inclusive cumulative weight exceeds
    ``u * mass``; the last eligible position when rounding leaves none.

    Restricting the pick to ``eligible`` (not trusting ``cum`` to be strictly monotone) makes
    "never outside the support" hold for any float rounding of the cumulative sum.
    """
    hit = eligible & (cum > (u * mass)[:, None])
    width = eligible.shape[1]
    last = width - 1 - jnp.argmax(eligible[:, ::-1], axis=1)
    return jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1), last).astype(jnp.int32)


def _truncated_pick(
    values: jax.Array,
    ids: jax.Array,
    temps: jax.Array,
    meta: SamplingMetadata,
    k: jax.Array,
    total: jax.Array,
    u: jax.Array,
    vocab_chunks: int,
) -> tuple[jax.Array, jax.Array]:
    """Sample from the most-probable-first prefix ``values``/``ids`` ([B, N], N <= V).

    ``total`` is the row's full-vocabulary weight (relative to its max), so top-p is measured
    against the whole distribution even when only a head of it is given. Returns the picked
    ids and whether the support provably lies inside the N given ranks.
    """
    width = values.shape[1]
    weights = jnp.exp((values - values[:, :1]) / temps[:, None])  # head = 1, descending
    cum = chunked_cumsum(weights, vocab_chunks)
    exclusive = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # mass strictly before each rank
    # top-p: rank r is kept iff the mass before it is < top_p (so rank 0 always is).
    # top_p >= 1 disables the filter outright: comparing against a total summed in another
    # order could otherwise drop a float-rounding sliver of tail tokens.
    len_p = jnp.where(
        meta.top_ps >= 1.0, width, jnp.sum(exclusive < (meta.top_ps * total)[:, None], axis=1)
    )
    # min-p: weights are p / max(p), so the threshold is min_p itself.
    len_m = jnp.sum(weights >= meta.min_ps[:, None], axis=1)
    len_nz = jnp.sum(weights > 0.0, axis=1)
    support = jnp.minimum(jnp.minimum(k, len_p), jnp.minimum(len_m, len_nz))
    support = jnp.maximum(support, 1)  # rank 0 has weight 1; guards NaN rows only
    ranks = jnp.arange(width, dtype=jnp.int32)[None, :]
    mass = jnp.take_along_axis(cum, (support - 1)[:, None], axis=1)[:, 0]
    rank = _inverse_cdf(cum, ranks < support[:, None], mass, u)
    picked = jnp.take_along_axis(ids, rank[:, None], axis=1)[:, 0]
    # Ranks >= N are excluded by some filter: top-k, top-p (the head already holds top_p of
    # the mass), min-p or zero probability (weights only fall after the last given rank).
    tail_weight = weights[:, -1]
    fits = (
        (k <= width)
        | ((meta.top_ps < 1.0) & (cum[:, -1] >= meta.top_ps * total))
        | (tail_weight < meta.min_ps)
        | (tail_weight <= 0.0)
    )
    return picked, fits


def sample(logits: jax.Array, meta: SamplingMetadata, head_size: int = 1024,
           vocab_chunks: int = 1) -> jax.Array:
    """Next token ids [B] int32 from logits [B, V].

    Every row takes the cheapest of three exact paths, chosen from that row's own parameters
    and logits only, so a row's token never depends on its batch-mates:

    - no truncation (top_k covers V, top_p >= 1, min_p == 0): inverse CDF in id order, O(V);
    - support provably inside the ``head_size`` most probable ids: that head only
      (``chunked_top_k``);
    - otherwise a stable sort of the whole row, run (``lax.cond``, real control flow under jit)
      only when some row of the batch needs it, and then only for those rows
      (``FALLBACK_ROWS`` per pass of a ``while_loop``), because XLA's sort is slow.

    ``head_size`` is static (part of the compiled shape); tests shrink it to reach the sort path.
    ``vocab_chunks`` (static): the most vocabulary chunks of the head's top-k and the
    cumulative sums (``vocab_chunks_for`` the platform). The head is the same either way; a
    token can differ only where a draw lands within float rounding of a cumulative sum.
    """
    logits = logits.astype(jnp.float32)
    # -0.0 -> 0.0: lax.top_k orders +0 before -0, which would break "ties to the lower id".
    logits = jnp.where(logits == 0.0, 0.0, logits)
    batch, vocab = logits.shape
    head = min(head_size, vocab)
    greedy = meta.temperatures < SAMPLING_EPS
    argmax = jnp.argmax(logits, axis=1).astype(jnp.int32)

    def sampled_rows() -> jax.Array:
        # Greedy rows get temperature 1 so nothing divides by zero; their result is replaced.
        temps = jnp.where(greedy, 1.0, meta.temperatures).astype(jnp.float32)
        ks = meta.top_ks
        k = jnp.where((ks <= 0) | (ks >= vocab), vocab, ks)
        u = _row_uniforms(meta.seeds, meta.steps)

        # Full-vocabulary weights in id order (relative to the row max, so in [0, 1]).
        weights = jnp.exp((logits - jnp.max(logits, axis=1, keepdims=True)) / temps[:, None])
        untruncated = (k >= vocab) & (meta.top_ps >= 1.0) & (meta.min_ps <= 0.0)
        if chunk_count(vocab, vocab_chunks) > 1:
            plain, total = chunked_inverse_cdf(weights, u, vocab_chunks)
        else:
            cum = jnp.cumsum(weights, axis=1)
            total = cum[:, -1]
            plain = _inverse_cdf(cum, weights > 0.0, total, u)

        # Ties: lower id first. The barriers keep XLA from fusing later slices (e.g. the last
        # column) into the top-k, which turns XLA:CPU's fast TopK back into a full sort. One
        # barrier per output: a barrier over the (values, ids) pair crashes XLA's SPMD
        # partitioner on a multi-device mesh when the logits are replicated (tp=1, ep>1).
        head_vals, head_ids = chunked_top_k(logits, head, vocab_chunks)
        head_vals = jax.lax.optimization_barrier(head_vals)
        head_ids = jax.lax.optimization_barrier(head_ids)
        head_pick, fits = _truncated_pick(head_vals, head_ids, temps, meta, k, total, u,
                                           vocab_chunks)
        needs_sort = ~greedy & ~untruncated & ~fits

        def sort_rows(rows: jax.Array) -> jax.Array:
            """Picks of the given rows ([R] batch indices) from their fully sorted logits."""
            sub = logits[rows]
            ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), sub.shape)
            # Stable sort of the negated logits: descending, equal values in ascending id order.
            neg_sorted, sorted_ids = jax.lax.sort(
                (-sub, ids), dimension=1, num_keys=1, is_stable=True
            )
            sub_meta = jax.tree.map(lambda a: a[rows], meta)
            picked, _ = _truncated_pick(-neg_sorted, sorted_ids, temps[rows], sub_meta,
                                        k[rows], total[rows], u[rows], vocab_chunks)
            return picked

        def full_sort() -> jax.Array:
            """The rows that need the sort, ``FALLBACK_ROWS`` at a time, until none is left."""
            per_pass = min(FALLBACK_ROWS, batch)

            def one_pass(state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                left, picks = state
                rows = jnp.nonzero(left, size=per_pass, fill_value=0)[0].astype(jnp.int32)
                real = jnp.arange(per_pass) < jnp.sum(left)  # fill rows are not written
                rows_or_past = jnp.where(real, rows, batch)  # out of bounds: dropped
                picks = picks.at[rows_or_past].set(sort_rows(rows), mode="drop")
                left = left.at[rows_or_past].set(False, mode="drop")
                return left, picks

            _, picks = jax.lax.while_loop(lambda state: jnp.any(state[0]), one_pass,
                                          (needs_sort, jnp.zeros((batch,), jnp.int32)))
            return picks

        if head < vocab:
            sort_pick = jax.lax.cond(
                jnp.any(needs_sort), full_sort, lambda: jnp.zeros((batch,), jnp.int32)
            )
        else:  # the head is the whole vocabulary: every row fits
            sort_pick = head_pick
        out = jnp.where(untruncated, plain, jnp.where(fits, head_pick, sort_pick))
        return jnp.where(greedy, argmax, out)

    # An all-greedy batch (the common case in tests and evals) skips everything but argmax.
    return jax.lax.cond(jnp.all(greedy), lambda: argmax, sampled_rows)
