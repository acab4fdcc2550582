"""A speculative verify step through a Gated DeltaNet layer, leaving its states exact.

A verify step feeds each request its last token and its ``m`` drafts; the target samples a
token after every one of them, and only then is it known how many drafts were accepted
(``a``, from 0 to ``m``). The layer's states must end as they would after the accepted
inputs alone (input positions ``0..a``), never after a rejected draft: the states are a
function of every earlier input, so unlike a KV page a wrong one cannot be left unread.

So a verify step runs the layer in two halves:

1. ``verify_forward`` (inside the layer, while acceptance is unknown): the one-token
   recurrence ``gated_delta.decode`` position by position (a ``lax.scan`` over the ``W``
   positions a row may have), for the outputs. The tables are not written; the layer's cache
   entry becomes a ``PendingStates``: the unchanged tables, the rows' slots, the layer's
   inputs by position ``[W, B, hidden]`` and its parameters.
2. ``commit`` (in the step, once the sampled tokens give each row's accepted count ``a``):
   the same recurrence again from the rows' states in the tables, over the same inputs, each
   row's states advancing at positions ``0..a`` only; the result is written to the rows'
   slots and the entry is the tables again, so the step's cache has the structure it was
   donated with.

Why this is exact: the states written are what ``decode`` computes over the accepted inputs,
in order, from the states before the step: what ``a + 1`` decode steps would have left.
Inputs after ``a`` (rejected drafts, and the bucket's padding past a row's tokens) never
reach them. Each position's output in the first half is a decode step's output too, so the
logits at the accepted positions (and the one after) are those of decoding the same tokens
one by one.

Cost: the replay repeats the layer's input projections, conv and state update for the step's
tokens (XLA drops the outputs it does not use); what lives until the step ends is the inputs,
``W x B x hidden`` per linear layer, not ``W`` copies of the states (at Qwen3.5-35B-A3B a
request's recurrent state is 2 MiB per layer, its inputs 4 KiB per position).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.linear_attention import gated_delta


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingStates:
    """A linear layer's cache entry between ``verify_forward`` and ``commit``."""

    tables: Any  # the layer's state tables as donated (a pytree, slot row on axis 0)
    slots: jax.Array  # [B] each row's state row
    inputs: jax.Array  # [W, B, hidden] the layer's input at each row's position j
    params: gated_delta.GatedDeltaParams
    dims: gated_delta.GatedDeltaDims = dataclasses.field(metadata={"static": True})


def _scan_decode(p: gated_delta.GatedDeltaParams, dims: gated_delta.GatedDeltaDims,
                 inputs: jax.Array, states: Any, advance: jax.Array | None,
                 ) -> tuple[Any, jax.Array]:
    """``decode`` over positions j of ``inputs`` [W, B, hidden] from ``states`` (a pytree of
    ``[B, ...]`` leaves, the tables' structure): (the final states, outputs [W, B, hidden]).
    ``advance`` [W, B] (None: always): whether row b's states take position j's step."""
    structure = jax.tree.structure(states)

    def position(carry: Any, step: tuple) -> tuple[Any, jax.Array]:
        x, keep = step
        y, conv, recurrent = gated_delta.decode(p, dims, x, *carry)
        new = jax.tree.unflatten(structure, jax.tree.leaves((conv, recurrent)))
        if keep is not None:
            new = jax.tree.map(
                lambda n, o: jnp.where(keep.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
                new, carry)
        return new, y

    return jax.lax.scan(position, states, (inputs, advance))


def verify_forward(
    p: gated_delta.GatedDeltaParams, dims: gated_delta.GatedDeltaDims, x: jax.Array,
    starts: jax.Array, lens: jax.Array, slots: jax.Array, tables: Any, width: int,
) -> tuple[jax.Array, PendingStates]:
    """x ``[T, hidden]`` (flat: row b's tokens at ``starts[b] .. starts[b] + lens[b] - 1``,
    at most ``width`` each) -> (y ``[T, hidden]``, zeros at tokens of no row; the pending
    states). ``tables``: the layer's cache entry ``(conv, recurrent)`` (each a pytree)."""
    n = x.shape[0]
    cols = jnp.arange(width, dtype=jnp.int32)
    inputs = x[jnp.clip(starts[None, :] + cols[:, None], 0, n - 1)]  # [W, B, hidden]
    states = jax.tree.map(lambda t: t[slots], tables)
    _, ys = _scan_decode(p, dims, inputs, states, None)
    # back to the flat tokens: position j of row b -> token starts[b] + j (j < lens[b])
    target = jnp.where(cols[:, None] < lens[None, :], starts[None, :] + cols[:, None], n)
    y = jnp.zeros_like(x).at[target.reshape(-1)].set(
        ys.reshape(-1, x.shape[-1]).astype(x.dtype), mode="drop")
    return y, PendingStates(tables, slots, inputs, p, dims)


def commit(entry: Any, accepted: jax.Array) -> Any:
    """The cache entry after a verify step: a ``PendingStates``' tables with each row's
    states after input position ``accepted[b]`` written to its slot; any other entry (a KV
    array) as it is."""
    if not isinstance(entry, PendingStates):
        return entry
    width = entry.inputs.shape[0]
    advance = jnp.arange(width, dtype=jnp.int32)[:, None] <= accepted[None, :]  # [W, B]
    states = jax.tree.map(lambda t: t[entry.slots], entry.tables)
    final, _ = _scan_decode(entry.params, entry.dims, entry.inputs, states, advance)
    return jax.tree.map(lambda t, s: t.at[entry.slots].set(s.astype(t.dtype)),
                        entry.tables, final)
