"""How a batch is described: ForwardMode, the host-side ModelWorkerBatch and the device-side
ForwardBatch (a pytree, the jitted step's input).

A leaf module: layers, models, the model runner and the scheduler all import it, and it
imports none of them.

Padding conventions (the jitted step relies on them):
- padded tokens come after every real token; they belong to no row, sit at position 0 and
  write their K/V to the reserved slot 0 (page 0), which no request ever reads;
- padded rows have ``prefix_lens == extend_lens == 0`` and the request slot ``NO_REQ_SLOT``
  (a spare row of the next-inputs buffer and of the device page table).

An input id of -1 means "the token this request sampled last": it is read on the device from
the next-inputs buffer, so a decode step can be dispatched before the previous step's tokens
have reached the host (overlap scheduling). An EAGLE / NEXTN verify step reads its drafts and
first position there too (speculative/device_inputs.py).

What the host sends per step grows with the batch's tokens and rows only: a request's page
table lives on the device (``ModelRunner.req_to_page``), and the per-token row, position
and the rows' logit indices are derived inside the step from ``extend_lens``.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.sampling.sampling_metadata import SamplingMetadata
from sgl_jax.srt.sampling.sampling_params import MAX_TOKEN_IDS_LOGPROB


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = 2  # one new token per request
    # Speculative decoding: each request's last token and its draft tokens, computed like an
    # extend (on top of its cached KV), sampled at every token (each token's own row).
    TARGET_VERIFY = 3

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogprobInputs:
    """What the step needs for logprobs (present only when some request asks): the asked ids
    of every logits row, and extra logits rows at prompt tokens (input logprobs): after the
    ``B`` sampled rows come ``P`` rows at ``extra_tokens``, scored on ``extra_targets`` (the next
    prompt token) at ``extra_temperatures``."""

    token_ids: jax.Array  # [B + P, MAX_TOKEN_IDS_LOGPROB] int32, -1 = none
    extra_tokens: jax.Array  # [P] int32 token index in the batch (padding: 0)
    extra_targets: jax.Array  # [P] int32 (padding: -1)
    extra_temperatures: jax.Array  # [P] float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DpOrder:
    """Where the scheduler's rows and tokens sit in a DP-attention batch: the scheduler's
    i-th row (real rows first, then padding) is row ``rows[i]`` of the rank-by-rank layout,
    its j-th token is token ``tokens[j]``. The step computes in the rank layout and returns
    its outputs in the scheduler's order (``outputs[rows]``), so nothing after the step
    knows about ranks, except the routed-experts rows: the capturer puts those in the
    scheduler's order on the host (``RoutedExpertsCapturer.select_rows``)."""

    rows: jax.Array  # [B] int32, a permutation
    tokens: jax.Array  # [T] int32, a permutation


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    input_ids: jax.Array  # [T] int32; -1: the request's last sampled token (on device)
    out_cache_loc: jax.Array  # [T] int32, KV slot each token writes (page * page_size + offset)
    req_pool_indices: jax.Array  # [B] int32, request slot of each row
    prefix_lens: jax.Array  # [B] int32, tokens already in the KV cache before this batch
    extend_lens: jax.Array  # [B] int32, new tokens of each row (1 in decode, 0 for padding)
    sampling: SamplingMetadata
    forward_mode: ForwardMode = dataclasses.field(metadata={"static": True})
    logprobs: LogprobInputs | None = None  # None: no request asks (no logprob work at all)
    # Data-parallel attention (``dp_size`` > 1): rows and tokens are laid out rank by rank,
    # ``B / dp_size`` rows and ``T / dp_size`` tokens each, every rank's padding after its
    # real rows/tokens (see ``DpOrder``). 1: the plain layout above.
    dp_size: int = dataclasses.field(default=1, metadata={"static": True})
    dp_order: DpOrder | None = None
    # EAGLE (speculative/eagle.py), in extend and verify steps; None otherwise. Per row: the
    # token after its last one when the host knows it (a prompt chunk's end; -1: the sampled
    # one), and the KV slots of the draft chain's positions after the row's tokens.
    draft_next_ids: jax.Array | None = None  # [B] int32
    draft_scratch: jax.Array | None = None  # [B, num_steps - 1] int32
    # EAGLE / NEXTN verify steps: the KV slots of every position a row may touch from its
    # first position's lower bound ``prefix_lens`` on (speculative/device_inputs.py); the
    # step derives ``out_cache_loc`` and ``draft_scratch`` from them. [B, slot_width] int32.
    verify_slots: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.shape[0]

    @property
    def sampled_rows(self) -> int:
        """Logits rows the step samples: one per request, or one per token in a verify step."""
        return self.num_tokens if self.forward_mode.is_verify else self.batch_size

    # -- derived on the device (traced), so the host does not send them -----------------------
    @property
    def extend_starts(self) -> jax.Array:
        """[B] index of each row's first token (a rank's rows' tokens are back to back from
        the rank's first token)."""
        if self.dp_size == 1:
            return jnp.cumsum(self.extend_lens) - self.extend_lens
        lens = self.extend_lens.reshape(self.dp_size, -1)
        rank_first = jnp.arange(self.dp_size, dtype=jnp.int32)[:, None] * (
            self.num_tokens // self.dp_size)
        return (jnp.cumsum(lens, axis=1) - lens + rank_first).reshape(-1)

    @property
    def seq_lens(self) -> jax.Array:
        """[B] tokens of each row once this batch is in the cache (0 for padding rows)."""
        return self.prefix_lens + self.extend_lens

    @property
    def token_to_req(self) -> jax.Array:
        """[T] batch row of each token; ``batch_size`` for padded tokens."""
        if self.dp_size == 1:
            ends = jnp.cumsum(self.extend_lens)
            token = jnp.arange(self.num_tokens, dtype=jnp.int32)
            return jnp.searchsorted(ends, token, side="right").astype(jnp.int32)
        rows, tokens = self.batch_size // self.dp_size, self.num_tokens // self.dp_size
        ends = jnp.cumsum(self.extend_lens.reshape(self.dp_size, rows), axis=1)
        token = jnp.arange(tokens, dtype=jnp.int32)
        local = jax.vmap(lambda e: jnp.searchsorted(e, token, side="right"))(ends)
        first_row = jnp.arange(self.dp_size, dtype=jnp.int32)[:, None] * rows
        return jnp.where(local < rows, local + first_row, self.batch_size).astype(
            jnp.int32).reshape(-1)

    @property
    def positions(self) -> jax.Array:
        """[T] absolute position of each token in its request (0 for padded tokens)."""
        row = self.token_to_req
        token = jnp.arange(self.num_tokens, dtype=jnp.int32)
        start = jnp.take(self.extend_starts, row, mode="fill", fill_value=0)
        prefix = jnp.take(self.prefix_lens, row, mode="fill", fill_value=0)
        return jnp.where(row < self.batch_size, prefix + token - start, 0)

    @property
    def logits_indices(self) -> jax.Array:
        """[B (+ P)] the tokens whose logits the step computes: each row's last new token (it
        samples from it; in a verify step every token), then the extra input-logprob tokens,
        if any."""
        if self.forward_mode.is_verify:
            last = jnp.arange(self.num_tokens, dtype=jnp.int32)
        else:
            last = jnp.maximum(self.extend_starts + self.extend_lens - 1, 0)
        if self.logprobs is None:
            return last
        return jnp.concatenate([last, self.logprobs.extra_tokens])


def shape_key(batch: ForwardBatch) -> tuple[int, ...]:
    """What a compiled step is specialised on (besides the model's own shapes): mode, tokens,
    rows, and with logprobs the extra input-logprob rows (-1: no logprobs)."""
    extra = -1 if batch.logprobs is None else batch.logprobs.extra_tokens.shape[0]
    return (int(batch.forward_mode), batch.num_tokens, batch.batch_size, extra)


def make_padding_batch(
    mode: ForwardMode, num_tokens: int, batch_size: int, vocab_size: int, no_req_slot: int,
    padding_slots: list[int] | None = None, draft_steps: int = 0, verify_slot_width: int = 0,
) -> ForwardBatch:
    """An all-padding batch of the given shape (used to compile a bucket ahead of time).
    ``padding_slots``: DP attention's, one per rank (``num_tokens`` and ``batch_size`` are
    then the whole batch's, split evenly over the ranks). ``verify_slot_width``: EAGLE /
    NEXTN verify batches' ``verify_slots`` width."""
    zeros_b = np.zeros(batch_size, np.int32)
    out_cache_loc = np.zeros(num_tokens, np.int32)
    dp_fields = {}
    if padding_slots is not None and len(padding_slots) > 1:
        dp = len(padding_slots)
        out_cache_loc = np.repeat(np.asarray(padding_slots, np.int32), num_tokens // dp)
        dp_fields = {"dp_size": dp, "dp_order": DpOrder(
            rows=np.arange(batch_size, dtype=np.int32),
            tokens=np.arange(num_tokens, dtype=np.int32))}
    if draft_steps and not mode.is_decode:
        dp_fields["draft_next_ids"] = np.full(batch_size, -1, np.int32)
        dp_fields["draft_scratch"] = np.zeros((batch_size, draft_steps - 1), np.int32)
        if mode.is_verify:
            dp_fields["verify_slots"] = np.zeros((batch_size, verify_slot_width), np.int32)
    return ForwardBatch(
        **dp_fields,
        input_ids=np.zeros(num_tokens, np.int32),
        out_cache_loc=out_cache_loc,
        req_pool_indices=np.full(batch_size, no_req_slot, np.int32),
        prefix_lens=zeros_b,
        extend_lens=zeros_b.copy(),
        sampling=SamplingMetadata.from_params(
            [], [], [], num_tokens if mode.is_verify else batch_size, vocab_size),
        forward_mode=mode,
    )


@dataclasses.dataclass
class LogprobRequest:
    """Host side of ``LogprobInputs``, unpadded: per request the asked ids (None: none), and
    the extra prompt tokens (batch token index, next prompt token, temperature, asked ids)."""

    token_ids: list[list[int] | None]
    extra_tokens: list[int] = dataclasses.field(default_factory=list)
    extra_targets: list[int] = dataclasses.field(default_factory=list)
    extra_temperatures: list[float] = dataclasses.field(default_factory=list)
    extra_token_ids: list[list[int] | None] = dataclasses.field(default_factory=list)

    def padded(self, padded_rows: int, padded_extra: int) -> LogprobInputs:
        b, p = len(self.token_ids), len(self.extra_tokens)
        ids = np.full((padded_rows + padded_extra, MAX_TOKEN_IDS_LOGPROB), -1, np.int32)
        for row, asked in [*enumerate(self.token_ids),
                           *((padded_rows + j, a) for j, a in enumerate(self.extra_token_ids))]:
            if asked:
                ids[row, : len(asked)] = asked
        assert b <= padded_rows and p <= padded_extra
        extra_tokens = np.zeros(padded_extra, np.int32)
        extra_tokens[:p] = self.extra_tokens
        targets = np.full(padded_extra, -1, np.int32)
        targets[:p] = self.extra_targets
        temps = np.ones(padded_extra, np.float32)
        temps[:p] = self.extra_temperatures
        return LogprobInputs(ids, extra_tokens, targets, temps)


@dataclasses.dataclass
class ModelWorkerBatch:
    """Host (numpy) description of one batch, unpadded; the scheduler builds it."""

    forward_mode: ForwardMode
    req_pool_indices: np.ndarray  # [B] int32
    prefix_lens: np.ndarray  # [B] int32: positions already in the KV cache
    extend_lens: np.ndarray  # [B] int32: new tokens per request (1 in decode)
    input_ids: np.ndarray  # [T] int32, the requests' new tokens back to back (-1: on device)
    out_cache_loc: np.ndarray  # [T] int32, KV slot of every new token
    sampling_params: list  # per request: objects with temperature/top_p/top_k/min_p
    seeds: list[int]
    steps: list[int]  # per request: index of the output token being sampled
    return_routed_experts: bool = False  # any request asks: copy the routed rows to host
    # Per request, whether it asked (bool [B]) when only some did; None when all or none did.
    routed_reqs: np.ndarray | None = None
    logprobs: LogprobRequest | None = None  # some request asks for logprobs
    # Data-parallel attention: the attention rank of each row (int32 [B], any order; a row's
    # KV slots are its rank's). None when dp_size == 1.
    dp_ranks: np.ndarray | None = None
    # EAGLE: ForwardBatch's fields of the same names, unpadded ([B], [B, num_steps - 1]).
    draft_next_ids: np.ndarray | None = None
    draft_scratch: np.ndarray | None = None
    verify_slots: np.ndarray | None = None  # EAGLE / NEXTN verify: [B, slot_width]
    # Constrained decoding: [B, ceil(V / 32)] int32 packed allowed ids; None: no row is.
    vocab_mask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def routed_tokens(self) -> np.ndarray | None:
        """Positions in the batch of the tokens whose routed rows go to the host (int32,
        ascending): those of the requests that asked. None: every token's (or no copy)."""
        if not self.return_routed_experts or self.routed_reqs is None:
            return None
        per_token = np.repeat(np.asarray(self.routed_reqs, bool), self.extend_lens)
        return np.flatnonzero(per_token).astype(np.int32)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)


def build_forward_batch(
    mwb: ModelWorkerBatch, padded_tokens: int, padded_rows: int, vocab_size: int,
    no_req_slot: int,
) -> ForwardBatch:
    """Pads a ModelWorkerBatch to a compiled shape.

    Every array is freshly allocated: on the CPU backend the step may read numpy memory in
    place, so nothing handed to a step is ever reused or mutated afterwards.
    """
    t, b = mwb.num_tokens, mwb.batch_size
    if t > padded_tokens or b > padded_rows:
        raise ValueError(f"batch of {t} tokens / {b} rows exceeds padding {padded_tokens}/{padded_rows}")

    def pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
        out = np.full(size, fill, dtype=np.int32)
        out[: len(values)] = values
        return out

    params, seeds, steps, sampled_rows = mwb.sampling_params, mwb.seeds, mwb.steps, padded_rows
    logprobs = mwb.logprobs
    if mwb.forward_mode.is_verify:
        # Every token samples with its request's parameters, at the output index it would
        # have without speculation (so a seeded request draws the same random numbers).
        lens = mwb.extend_lens
        params, seeds = _per_token(params, lens), _per_token(seeds, lens)
        steps = [s + j for s, n in zip(mwb.steps, lens, strict=True) for j in range(n)]
        sampled_rows = padded_tokens
        if logprobs is not None:
            logprobs = LogprobRequest(token_ids=_per_token(logprobs.token_ids, lens))
    return ForwardBatch(
        input_ids=pad(mwb.input_ids, padded_tokens, 0),
        out_cache_loc=pad(mwb.out_cache_loc, padded_tokens, 0),
        req_pool_indices=pad(mwb.req_pool_indices, padded_rows, no_req_slot),
        prefix_lens=pad(mwb.prefix_lens, padded_rows, 0),
        extend_lens=pad(mwb.extend_lens, padded_rows, 0),
        sampling=SamplingMetadata.from_params(params, seeds, steps, sampled_rows, vocab_size,
                                              vocab_mask=mwb.vocab_mask),
        forward_mode=mwb.forward_mode,
        # Extra rows are padded to the token bucket: one compiled variant per bucket.
        logprobs=None if logprobs is None else logprobs.padded(
            sampled_rows, padded_tokens if logprobs.extra_tokens else 0),
        **_draft_fields(mwb, padded_rows),
    )


def _draft_fields(mwb: ModelWorkerBatch, padded_rows: int) -> dict[str, np.ndarray]:
    if mwb.draft_scratch is None:
        return {}
    b = mwb.batch_size
    next_ids = np.full(padded_rows, -1, np.int32)
    next_ids[:b] = mwb.draft_next_ids
    scratch = np.zeros((padded_rows, mwb.draft_scratch.shape[1]), np.int32)
    scratch[:b] = mwb.draft_scratch
    fields = {"draft_next_ids": next_ids, "draft_scratch": scratch}
    if mwb.verify_slots is not None:
        slots = np.zeros((padded_rows, mwb.verify_slots.shape[1]), np.int32)
        slots[:b] = mwb.verify_slots
        fields["verify_slots"] = slots
    return fields


def _per_token(values: list, lens: np.ndarray) -> list:
    """Each request's value repeated for each of its tokens."""
    return [v for v, n in zip(values, lens, strict=True) for _ in range(int(n))]


def dp_rank_sizes(mwb: ModelWorkerBatch, dp_size: int) -> tuple[int, int]:
    """The largest rank's (tokens, rows) of a DP-attention batch: every rank is padded to the
    bucket of these."""
    ranks = np.asarray(mwb.dp_ranks)
    rows = np.bincount(ranks, minlength=dp_size)
    tokens = np.bincount(ranks, weights=mwb.extend_lens, minlength=dp_size).astype(int)
    return int(tokens.max()), int(rows.max())


def build_dp_forward_batch(
    mwb: ModelWorkerBatch, rank_tokens: int, rank_rows: int, vocab_size: int,
    no_req_slot: int, padding_slots: list[int],
) -> ForwardBatch:
    """Pads a DP-attention batch (``mwb.dp_ranks`` set) to ``rank_tokens`` / ``rank_rows`` per
    rank, laid out rank by rank (rank r: rows ``[r * rank_rows, ...)``, tokens
    ``[r * rank_tokens, ...)``, its real ones first). A rank's padded tokens write its own
    padding slot (``padding_slots[r]``: each rank writes only its shard of the KV cache).
    The scheduler's order is kept in ``dp_order`` (the step's outputs come back in it)."""
    dp = len(padding_slots)
    ranks = np.asarray(mwb.dp_ranks, np.int64)
    if len(ranks) != mwb.batch_size or (len(ranks) and not 0 <= ranks.min() <= ranks.max() < dp):
        raise ValueError(f"dp_ranks {ranks} must give a rank in [0, {dp}) to each row")
    rows, tokens = dp * rank_rows, dp * rank_tokens
    compact = build_forward_batch(mwb, tokens, rows, vocab_size, no_req_slot)
    # Row i of the scheduler's order -> its place in the rank layout; padding rows fill the
    # places no real row took, in order (so the permutation is complete).
    row_place = np.empty(rows, np.int64)
    token_place = np.empty(tokens, np.int64)
    row_used = np.zeros(dp, np.int64)
    token_used = np.zeros(dp, np.int64)
    start = 0
    for i, (r, n) in enumerate(zip(ranks, mwb.extend_lens, strict=True)):
        if row_used[r] == rank_rows or token_used[r] + n > rank_tokens:
            raise ValueError(f"rank {r} has more than {rank_rows} rows / {rank_tokens} tokens")
        row_place[i] = r * rank_rows + row_used[r]
        token_place[start : start + n] = r * rank_tokens + token_used[r] + np.arange(n)
        row_used[r] += 1
        token_used[r] += n
        start += n
    row_free = np.ones(rows, bool)
    row_free[row_place[: mwb.batch_size]] = False
    row_place[mwb.batch_size :] = np.flatnonzero(row_free)
    token_free = np.ones(tokens, bool)
    token_free[token_place[:start]] = False
    token_place[start:] = np.flatnonzero(token_free)

    def place(x: np.ndarray, where: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        out[where] = x
        return out

    def by_row(x: np.ndarray) -> np.ndarray:
        return place(np.asarray(x), row_place)

    out_cache_loc = place(compact.out_cache_loc, token_place)
    pad_tokens = np.flatnonzero(token_free)
    out_cache_loc[pad_tokens] = np.asarray(padding_slots, np.int32)[pad_tokens // rank_tokens]
    logprobs = compact.logprobs
    if logprobs is not None:
        logprobs = LogprobInputs(
            token_ids=np.concatenate([by_row(logprobs.token_ids[:rows]),
                                      logprobs.token_ids[rows:]]),
            extra_tokens=token_place[logprobs.extra_tokens].astype(np.int32),
            extra_targets=logprobs.extra_targets,
            extra_temperatures=logprobs.extra_temperatures,
        )
    return dataclasses.replace(
        compact,
        input_ids=place(compact.input_ids, token_place),
        out_cache_loc=out_cache_loc,
        req_pool_indices=by_row(compact.req_pool_indices),
        prefix_lens=by_row(compact.prefix_lens),
        extend_lens=by_row(compact.extend_lens),
        sampling=jax.tree.map(by_row, compact.sampling),
        logprobs=logprobs,
        dp_size=dp,
        dp_order=DpOrder(rows=row_place.astype(np.int32), tokens=token_place.astype(np.int32)),
    )
