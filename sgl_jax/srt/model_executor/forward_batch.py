"""ForwardBatch: the device-side view of one padded batch (a pytree, the jitted forward's input).

Padding conventions (the jitted forward relies on them):
- padded tokens have ``token_to_req == padded_bs`` (no real row), position 0 and write their K/V
  to the reserved slot 0, which no request ever reads;
- padded rows have ``prefix_lens == 0``, an all-zero page-table row, and the
  request slot ``NO_REQ_SLOT`` (a spare row of the last-token buffer).

An input id of -1 means "the token this request sampled last": it is read on the device from
the last-token buffer, so a decode step can be dispatched before the previous step's tokens
have reached the host (overlap scheduling).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np

from sgl_jax.srt.layers.sampler import SamplingMetadata


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
    positions: jax.Array  # [T] int32, absolute position of each token in its request
    out_cache_loc: jax.Array  # [T] int32, KV slot each token writes
    token_to_req: jax.Array  # [T] int32, batch row of each token (padded_bs for padding)
    req_pool_indices: jax.Array  # [B] int32, request slot of each row (the last-token buffer row)
    prefix_lens: jax.Array  # [B] int32, tokens already in the KV cache before this batch
    page_table: jax.Array  # [B, W] int32, req_to_token rows: KV slot of every position
    logits_indices: jax.Array  # [B] int32, token index whose logits each row samples from
    sampling: SamplingMetadata
    forward_mode: ForwardMode = dataclasses.field(metadata={"static": True})

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.shape[0]


def shape_key(batch: ForwardBatch) -> tuple[int, int, int]:
    """What a compiled forward is specialised on (besides the model's own shapes)."""
    return (int(batch.forward_mode), batch.num_tokens, batch.batch_size)


def make_padding_batch(
    mode: ForwardMode, num_tokens: int, batch_size: int, page_width: int, vocab_size: int,
    no_req_slot: int,
) -> ForwardBatch:
    """An all-padding batch of the given shape (used to compile a bucket ahead of time)."""
    zeros_t = np.zeros(num_tokens, np.int32)
    zeros_b = np.zeros(batch_size, np.int32)
    return ForwardBatch(
        input_ids=zeros_t,
        positions=zeros_t,
        out_cache_loc=zeros_t,
        token_to_req=np.full(num_tokens, batch_size, np.int32),
        req_pool_indices=np.full(batch_size, no_req_slot, np.int32),
        prefix_lens=zeros_b,
        page_table=np.zeros((batch_size, page_width), np.int32),
        logits_indices=zeros_b,
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

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.req_pool_indices)


def build_forward_batch(
    mwb: ModelWorkerBatch,
    req_to_token: np.ndarray,
    padded_tokens: int,
    padded_rows: int,
    vocab_size: int,
    no_req_slot: int,
) -> ForwardBatch:
    """Pads a ModelWorkerBatch to a compiled shape.

    Every array is freshly allocated: on the CPU backend the forward may read numpy memory in
    place, so nothing handed to a forward is ever reused or mutated afterwards.
    """
    t, b = mwb.num_tokens, mwb.batch_size
    if t > padded_tokens or b > padded_rows:
        raise ValueError(f"batch of {t} tokens / {b} rows exceeds padding {padded_tokens}/{padded_rows}")
    extend_lens = mwb.extend_lens.astype(np.int32)
    prefix_lens = mwb.prefix_lens.astype(np.int32)
    row_of_token = np.repeat(np.arange(b, dtype=np.int32), extend_lens)
    starts = np.cumsum(extend_lens) - extend_lens
    positions = np.arange(t, dtype=np.int32) - np.repeat(starts, extend_lens) + np.repeat(
        prefix_lens, extend_lens
    )

    def pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
        out = np.full(size, fill, dtype=np.int32)
        out[: len(values)] = values
        return out

    page_table = np.zeros((padded_rows, req_to_token.shape[1]), dtype=np.int32)
    page_table[:b] = req_to_token[mwb.req_pool_indices]
    return ForwardBatch(
        input_ids=pad(mwb.input_ids, padded_tokens, 0),
        positions=pad(positions, padded_tokens, 0),
        out_cache_loc=pad(mwb.out_cache_loc, padded_tokens, 0),
        token_to_req=pad(row_of_token, padded_tokens, padded_rows),
        req_pool_indices=pad(mwb.req_pool_indices, padded_rows, no_req_slot),
        prefix_lens=pad(prefix_lens, padded_rows, 0),
        page_table=page_table,
        logits_indices=pad(starts + extend_lens - 1, padded_rows, 0),
        sampling=SamplingMetadata.from_params(
            mwb.sampling_params, mwb.seeds, mwb.steps, padded_rows, vocab_size
        ),
        forward_mode=mwb.forward_mode,
    )
