"""Token dispatch of DP attention's MoE by an all-to-all: each device receives only the
assignments to its own experts (``--moe-dispatch ragged_all_to_all``).

The default dispatch (``ep_moe.ep_moe_forward(tokens_split=True)``) all-gathers every rank's
tokens to every device and reduce-scatters the sums back: ``T`` token rows in and out per
device and layer, whatever the routing. This one sends each token-expert assignment to the
device that holds its expert row and the weighted result back: ``k x T / ep`` rows each way,
which is less when ``k < ep``. Per device (inside the MoE ``shard_map``, manual over
"expert" and "tensor"):

1. its ``t`` tokens' ``t x k`` assignments are sorted by destination (the "expert" index of
   the device holding the physical row: rows are contiguous per device);
2. ``ragged_all_to_all`` over "expert" sends each destination its contiguous run of token
   rows, the destination-local expert rows and the routing weights; a receiver lays the runs
   of its sources one after the other (sources in rank order) in a buffer sized for the
   worst case (every assignment of every rank to it: ``ep x t x k`` rows), so nothing is ever
   dropped;
3. the expert backend runs once on the buffer (one assignment per row; rows past those
   received carry the sentinel row and contribute nothing), giving the weighted float32
   partial output of this device's slice of the experts' width;
4. a second ``ragged_all_to_all`` returns every result to its sender, at the place its
   assignment had in the sender's sorted order; the sender unsorts them, adds the k results
   of each token and then the "tensor" slices (``psum``).

Every assignment reaches the same expert row as with the all-gather dispatch, so the result
is the same up to float32 summation order.

XLA:CPU cannot execute ``ragged-all-to-all``; on CPU the collective is emulated with an
all-gather and per-source copies of exactly the documented semantics
(:func:`emulated_ragged_all_to_all`), so the dispatch logic above is what the CPU tests
check against the float64 reference, and a TPU runs the real collective.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"

RaggedAllToAll = Callable[..., jax.Array]


def emulated_ragged_all_to_all(
    operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
    output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s semantics from an all-gather (for XLA:CPU).

    Device ``s`` sends ``operand[input_offsets[d] : + send_sizes[d]]`` to each device ``d``,
    which writes it at ``output[output_offsets_s[d] : + ...]`` (``output_offsets`` are the
    sender's, in the receiver's buffer); the rest of ``output`` is kept. ``recv_sizes`` is
    implied by the senders' sizes (kept for the same signature)."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [n, rows, ...]
    starts, sizes, places = (jax.lax.all_gather(a, axis_name)[:, me]
                             for a in (input_offsets, send_sizes, output_offsets))  # [n]
    index = jnp.arange(output.shape[0])
    for src in range(operands.shape[0]):
        inside = (index >= places[src]) & (index < places[src] + sizes[src])
        rows = jnp.clip(starts[src] + index - places[src], 0, operand.shape[0] - 1)
        picked = jnp.take(operands[src], rows, axis=0)
        mask = inside.reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(mask, picked, output)
    return output


def ragged_collective(platform: str) -> RaggedAllToAll:
    """The collective the platform can run: XLA's own, or the emulation on CPU."""
    return emulated_ragged_all_to_all if platform == "cpu" else jax.lax.ragged_all_to_all


def all_to_all_experts(
    backend: Callable[..., jax.Array], collective: RaggedAllToAll, x: jax.Array,
    rows: jax.Array, topk_weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """Per device, inside the MoE ``shard_map``: this rank's tokens x ``[t, H]``, their
    physical expert rows and weights ``[t, k]``, this device's stacked expert weights.
    Returns this rank's ``[t, H]`` output in x's dtype (module docstring)."""
    num_tokens, top_k = rows.shape
    ranks = jax.lax.axis_size(EXPERT_AXIS)
    rows_here = w_gate.shape[0]
    flat_rows = rows.reshape(-1)
    dest = flat_rows // rows_here  # [A] the "expert" index owning each assignment's row
    order = jnp.argsort(dest, stable=True)
    send_sizes = jnp.sum(dest[:, None] == jnp.arange(ranks)[None, :], axis=0,
                         dtype=jnp.int32)  # [ranks]
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    # sizes[s, d]: what rank s sends rank d. Rank d lays its sources out in rank order.
    sizes = jax.lax.all_gather(send_sizes, EXPERT_AXIS)  # [ranks, ranks]
    me = jax.lax.axis_index(EXPERT_AXIS)
    placed_before = jnp.cumsum(sizes, axis=0) - sizes  # [s, d]: rows of sources < s at d
    output_offsets = placed_before[me].astype(jnp.int32)  # where my runs go at each d
    recv_sizes = sizes[:, me]  # [ranks] what each source sends me
    capacity = ranks * num_tokens * top_k  # every assignment of every rank to me

    def send(values: jax.Array, fill: float | int) -> jax.Array:
        out = jnp.full((capacity,) + values.shape[1:], fill, values.dtype)
        return collective(values, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                          axis_name=EXPERT_AXIS)

    token_of = order // top_k
    got_x = send(jnp.take(x, token_of, axis=0), 0)
    # Rows at their destination: rows are contiguous per device, so a subtraction.
    local_rows = jnp.take(flat_rows - dest * rows_here, order).astype(jnp.int32)
    got_rows = send(local_rows, rows_here)  # unused buffer rows: the sentinel
    got_weights = send(jnp.take(topk_weights.reshape(-1), order), 0)
    # One assignment per row: the backend weights and returns it (float32 partial).
    partial = backend(got_x, got_rows[:, None], got_weights[:, None], w_gate, w_up, w_down)
    # Back to the senders, at their sorted positions: the roles of the offsets swap.
    received_at = placed_before[:, me].astype(jnp.int32)  # where each source's run sits here
    back = collective(partial, jnp.zeros((num_tokens * top_k, partial.shape[1]), partial.dtype),
                      received_at, recv_sizes, input_offsets_of(sizes, me), send_sizes,
                      axis_name=EXPERT_AXIS)
    unsorted = jnp.zeros_like(back).at[order].set(back)
    mine = jnp.sum(unsorted.reshape(num_tokens, top_k, -1), axis=1)
    return jax.lax.psum(mine, TENSOR_AXIS).astype(x.dtype)


def input_offsets_of(sizes: jax.Array, me: jax.Array) -> jax.Array:
    """Where, in each sender d's sorted buffer, its run to rank ``me`` starts: the return
    trip's output offsets. ``sizes[s, d]`` is what rank s sends rank d."""
    mine_per_sender = jnp.cumsum(sizes, axis=1) - sizes  # [s, d]: s's runs to ranks < d
    return mine_per_sender[:, me].astype(jnp.int32)
