"""Verify steps whose inputs live on the device (EAGLE and NEXTN), so that the scheduler can
launch a request's next verify step before it has processed the one in flight (overlap
scheduling under speculation; docs/speculative.md).

A verify step with drafts in the step knows, on the device, everything its successor feeds:
the target's token after the last accepted one, the new drafts, and the position of that
token. The step writes them to ``next_inputs[req_slot]`` (``[slots, 2 + num_steps]``: the
token, its position, the drafts; an extend step writes the same for the token it samples),
and the next verify step reads them where the host sent ``-1`` as the input id.

What the host cannot know before processing the step in flight is how many tokens it kept,
so it sends a lower bound ``L`` of each row's first position (``prefix_lens``) and the KV
slots of every position the step may touch from there (``verify_slots [B, slot_width]``):
up to ``num_steps`` positions of uncertainty, the row's tokens and the draft chain's scratch.
The device reads the row's true first position ``s`` from ``next_inputs`` and takes the slots
from ``s - L`` on. Where the host knows everything (nothing in flight) it sends the input ids
and ``L = s``, and the same program reads its slots from offset 0.

Sampling: a token's output index (the seeded sampler's step) shifts by the same ``s - L``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sgl_jax.srt.forward_batch_info import ForwardBatch

TOKEN, POSITION, FIRST_DRAFT = 0, 1, 2  # the columns of ``next_inputs``


def slot_width(num_draft_tokens: int, num_steps: int) -> int:
    """Slots a verify row may need: ``num_steps`` positions of uncertainty in where it starts
    (its predecessor in flight kept 1 to ``num_draft_tokens`` tokens), then its own
    ``num_draft_tokens`` positions and the draft chain's ``num_steps - 1`` scratch slots."""
    return num_steps + num_draft_tokens + num_steps - 1


def next_inputs_width(num_steps: int) -> int:
    return FIRST_DRAFT + num_steps


def resolve(batch: ForwardBatch, next_inputs: jax.Array) -> ForwardBatch:
    """The verify batch with its inputs, first positions, KV slots, scratch slots and sampler
    steps as the device knows them (traced)."""
    assert batch.verify_slots is not None
    t, rows = batch.num_tokens, batch.batch_size
    starts, lens = batch.extend_starts, batch.extend_lens
    token_to_req = batch.token_to_req
    row = jnp.minimum(token_to_req, rows - 1)
    real = token_to_req < rows
    j = jnp.arange(t, dtype=jnp.int32) - starts[row]  # index of the token within its row
    state = next_inputs[batch.req_pool_indices]  # [B, 2 + num_steps]
    # A row reads its inputs from the device when the host sent -1 as its first input id.
    on_device = (batch.input_ids[jnp.minimum(starts, t - 1)] < 0) & (lens > 0)
    first = jnp.where(on_device, state[:, POSITION], batch.prefix_lens)
    offset = first - batch.prefix_lens  # [B] >= 0; 0 where the host knew
    column = jnp.where(real, offset[row] + j, 0)
    out_cache_loc = jnp.where(real, batch.verify_slots[row, column], 0)
    fed = state[row, jnp.where(j == 0, TOKEN, FIRST_DRAFT - 1 + j)]
    input_ids = jnp.where(batch.input_ids < 0, fed, batch.input_ids)
    scratch_steps = batch.draft_scratch.shape[1]
    scratch_cols = (offset + lens)[:, None] + jnp.arange(scratch_steps, dtype=jnp.int32)
    scratch = jnp.take_along_axis(batch.verify_slots, scratch_cols, axis=1)
    sampling = dataclasses.replace(batch.sampling,
                                   steps=batch.sampling.steps + jnp.where(real, offset[row], 0))
    return dataclasses.replace(batch, input_ids=input_ids, out_cache_loc=out_cache_loc,
                               prefix_lens=first, draft_scratch=scratch, sampling=sampling)


def record(next_inputs: jax.Array, batch: ForwardBatch, next_ids: jax.Array,
           drafts: jax.Array, accepted: jax.Array | None) -> jax.Array:
    """``next_inputs`` with each row's next token, its position and the new drafts (traced).
    ``accepted``: a verify step's accepted drafts per row (None in an extend step, whose rows
    sample one token each, at ``seq_lens``)."""
    if accepted is None:
        token, position = next_ids[: batch.batch_size], batch.seq_lens
    else:
        token = jnp.take(next_ids, batch.extend_starts + accepted, mode="clip")
        position = batch.prefix_lens + accepted + 1
    values = jnp.concatenate([token[:, None], position[:, None], drafts], axis=1)
    return next_inputs.at[batch.req_pool_indices].set(values.astype(next_inputs.dtype))
