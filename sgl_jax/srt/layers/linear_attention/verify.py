"""A speculative verify step through a Gated DeltaNet layer, leaving its states exact.

A verify step feeds each request its last token and its ``m`` drafts; the target samples a
token after every one of them, and only then is it known how many drafts were accepted
(``a``, from 0 to ``m``). The layer's states must end as they would after the accepted
inputs alone (input positions ``0..a``), never after a rejected draft: the states are a
function of every earlier input, so unlike a KV page a wrong one cannot be left unread.

So a verify step runs the layer in two halves:

1. ``verify_forward`` (inside the layer, while acceptance is unknown): the one-token
   recurrence ``gated_delta.decode`` position by position (a ``lax.scan`` over the ``W``
   positions a row may have), keeping the states after every position: ``[W, B, ...]`` per
   state array. The tables are not written; the layer's cache entry becomes a
   ``PendingStates`` (the unchanged tables, the per-position states, the rows' slots).
2. ``commit`` (in the step, once the sampled tokens give each row's accepted count ``a``):
   each row's states after position ``a`` are written to its slot's rows of the tables; the
   entry is the tables again, so the step's cache has the structure it was donated with.

Why this is exact: the states written are those ``decode`` computed after input ``a``,
which is what ``a + 1`` decode steps over the accepted inputs would have left (the same
function on the same inputs in the same order); inputs after ``a`` only fed the per-position
states that are dropped, and positions past a row's real tokens (bucket padding) come after
its last real one, whose states are the latest ever selected. Each position's output is a
decode step's output too, so the logits at the accepted positions (and the one after) are
those of decoding the same tokens one by one.

Cost: the per-position states live until the step ends: ``W`` times a batch's states per
linear layer (Qwen3.5-35B-A3B: 2 MiB recurrent per request, layer and position).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear_attention import gated_delta


class PendingStates(NamedTuple):
    """A linear layer's cache entry between ``verify_forward`` and ``commit``."""

    tables: Any  # the layer's state tables as donated (a pytree, slot row on axis 0)
    per_position: Any  # the same pytree, each leaf [W, B, ...]: the states after position j
    slots: jax.Array  # [B] each row's state row


def verify_forward(
    p: gated_delta.GatedDeltaParams, dims: gated_delta.GatedDeltaDims, x: jax.Array,
    starts: jax.Array, lens: jax.Array, slots: jax.Array, tables: Any, width: int,
) -> tuple[jax.Array, PendingStates]:
    """x ``[T, hidden]`` (flat: row b's tokens at ``starts[b] .. starts[b] + lens[b] - 1``,
    at most ``width`` each) -> (y ``[T, hidden]``, zeros at tokens of no row; the pending
    states). ``tables``: the layer's cache entry ``(conv, recurrent)`` (each a pytree)."""
    n = x.shape[0]
    states = jax.tree.map(lambda t: t[slots], tables)  # [B, ...], the tables' structure
    structure = jax.tree.structure(states)

    def position(carry: Any, j: jax.Array) -> tuple[Any, tuple[jax.Array, Any]]:
        rows = jnp.clip(starts + j, 0, n - 1)
        y, conv, recurrent = gated_delta.decode(p, dims, x[rows], *carry)
        new = jax.tree.unflatten(structure, jax.tree.leaves((conv, recurrent)))
        return new, (y, new)

    _, (ys, per_position) = jax.lax.scan(position, states,
                                         jnp.arange(width, dtype=jnp.int32))
    # back to the flat tokens: position j of row b -> token starts[b] + j (j < lens[b])
    cols = jnp.arange(width, dtype=jnp.int32)
    target = jnp.where(cols[:, None] < lens[None, :], starts[None, :] + cols[:, None], n)
    y = jnp.zeros_like(x).at[target.reshape(-1)].set(
        ys.reshape(-1, x.shape[-1]).astype(x.dtype), mode="drop")
    return y, PendingStates(tables, per_position, slots)


def commit(entry: Any, accepted: jax.Array) -> Any:
    """The cache entry after a verify step: a ``PendingStates``' tables with each row's
    states after input position ``accepted[b]`` written to its slot; any other entry (a KV
    array) as it is."""
    if not isinstance(entry, PendingStates):
        return entry
    batch = jnp.arange(entry.slots.shape[0])

    def write(table: jax.Array, per_position: jax.Array) -> jax.Array:
        kept = per_position[jnp.clip(accepted, 0, per_position.shape[0] - 1), batch]
        return table.at[entry.slots].set(kept.astype(table.dtype))

    return jax.tree.map(write, entry.tables, entry.per_position)
