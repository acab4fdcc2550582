"""How a batch is described: ForwardMode, the host-side ModelWorkerBatch and the device-side
ForwardBatch (a pytree, the jitted step's input).

A leaf module: layers, models, the model runner and the scheduler all import it, and it
imports none of them.

Padding conventions (the jitted step relies on them):
- padded tokens come after every real token; they belong to no row, sit at position 0 and
  write their K/V to the reserved slot 0 (page 0), which no request ever reads;
- padded rows have ``prefix_lens == extend_lens == 0`` and the request slot ``NO_REQ_SLOT``
  (a spare row of the last-token buffer and of the device page table).

An input id of -1 means "the token this request sampled last": it is read on the device from
the last-token buffer, so a decode step can be dispatched before the previous step's tokens
have reached the host (overlap scheduling).

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


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix, possibly one chunk of a prompt
    DECODE = 2  # one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


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

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.shape[0]

    # -- derived on the device (traced), so the host does not send them -----------------------
    @property
    def extend_starts(self) -> jax.Array:
        """[B] index of each row's first token (rows' tokens are back to back)."""
        return jnp.cumsum(self.extend_lens) - self.extend_lens

    @property
    def seq_lens(self) -> jax.Array:
        """[B] tokens of each row once this batch is in the cache (0 for padding rows)."""
        return self.prefix_lens + self.extend_lens

    @property
    def token_to_req(self) -> jax.Array:
        """[T] batch row of each token; ``batch_size`` for padded tokens."""
        ends = jnp.cumsum(self.extend_lens)
        token = jnp.arange(self.num_tokens, dtype=jnp.int32)
        return jnp.searchsorted(ends, token, side="right").astype(jnp.int32)

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
        """[B] the token whose logits each row samples from: its last new token."""
        return jnp.maximum(self.extend_starts + self.extend_lens - 1, 0)


def shape_key(batch: ForwardBatch) -> tuple[int, int, int]:
    """What a compiled step is specialised on (besides the model's own shapes)."""
    return (int(batch.forward_mode), batch.num_tokens, batch.batch_size)


def make_padding_batch(
    mode: ForwardMode, num_tokens: int, batch_size: int, vocab_size: int, no_req_slot: int,
) -> ForwardBatch:
    """An all-padding batch of the given shape (used to compile a bucket ahead of time)."""
    zeros_b = np.zeros(batch_size, np.int32)
    return ForwardBatch(
        input_ids=np.zeros(num_tokens, np.int32),
        out_cache_loc=np.zeros(num_tokens, np.int32),
        req_pool_indices=np.full(batch_size, no_req_slot, np.int32),
        prefix_lens=zeros_b,
        extend_lens=zeros_b.copy(),
        sampling=SamplingMetadata.from_params([], [], [], batch_size, vocab_size),
        forward_mode=mode,
    )


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

    return ForwardBatch(
        input_ids=pad(mwb.input_ids, padded_tokens, 0),
        out_cache_loc=pad(mwb.out_cache_loc, padded_tokens, 0),
        req_pool_indices=pad(mwb.req_pool_indices, padded_rows, no_req_slot),
        prefix_lens=pad(mwb.prefix_lens, padded_rows, 0),
        extend_lens=pad(mwb.extend_lens, padded_rows, 0),
        sampling=SamplingMetadata.from_params(
            mwb.sampling_params, mwb.seeds, mwb.steps, padded_rows, vocab_size
        ),
        forward_mode=mwb.forward_mode,
    )
