"""The ``ragged`` expert backend: dropless sparse compute with ``jax.lax.ragged_dot``.

Each of the ``M = T * k`` token-expert assignments is computed once, by its own expert:

1. the assignments are flattened and stably sorted by expert row, so each expert's tokens are
   one contiguous group; assignments of experts this device does not hold carry the sentinel
   row ``E_l`` (see ``ep_moe.ep_moe_forward``), sort after every real group and are counted in
   no group;
2. the token rows are gathered in that order (``[M, H]``) and the gate, up and down
   projections are three grouped matmuls (``ragged_dot`` with the per-expert group sizes),
   accumulated in float32;
3. each row is scaled by its routing weight, the rows are put back in ``[T, k]`` order (a
   gather through the inverse permutation) and the k contributions of a token are summed.

FLOPs: ``2 * 3 * M * H * I`` for a grouped-matmul implementation (TPU), i.e. ``E / k`` times
fewer than the dense backend. Shapes are static (``M`` rows whatever the routing), so no token
is ever dropped and nothing recompiles when the routing changes.

Rows past ``sum(group_sizes)`` belong to no group. What ``ragged_dot`` writes there is not
part of its contract: JAX 0.10.2's CPU lowering (a group-masked dense dot) writes zeros, a TPU
grouped-matmul kernel may leave them unwritten. They are therefore masked with a select (not a
multiply: 0 * NaN is NaN) before anything is summed, so the result is correct either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.moe.activation import SILU, ExpertActivation


def sorted_assignments(local_ids: jax.Array, topk_weights: jax.Array, num_rows: int
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """[T, k] expert rows (``num_rows`` = sentinel: not on this device) and their weights ->
    ``(order, weight, inverse, group_sizes)``.

    ``order`` [T*k] sorts the flattened assignments by row (stable: within a group, token
    order), sentinel last; ``weight`` [T*k] float32 their weights in that order; ``inverse``
    [T*k] each assignment's sorted position; ``group_sizes`` [num_rows] int32 counts each
    row's assignments (the sentinel is not counted, so ``sum(group_sizes)`` is the number
    of local assignments).

    The weights ride the sort by row as a payload. Taking them afterwards by ``order``
    gives the same values, but XLA:TPU counts a 1-D gather at a whole 1,024-element tile
    per element (compile-only v5p, 65,536 assignments: the argsort, that gather and the
    inverse's scatter 276 MB, the sort with its payload and the scatter 3.9 MB; each MoE
    layer of the 235B's DP prefill sorts that many on every device). The inverse stays a
    scatter: XLA counts a 1-D scatter at its operands (0.8 MB).
    """
    flat = local_ids.reshape(-1)
    iota = jnp.arange(flat.shape[0], dtype=jnp.int32)
    _, order, weight = jax.lax.sort(
        (flat, iota, topk_weights.reshape(-1).astype(jnp.float32)), num_keys=1,
        is_stable=True)
    inverse = jnp.zeros_like(order).at[order].set(iota, unique_indices=True)
    rows = jnp.arange(num_rows, dtype=flat.dtype)
    group_sizes = jnp.sum(flat[:, None] == rows[None, :], axis=0, dtype=jnp.int32)
    return order, weight, inverse, group_sizes


def ragged_experts(
    x: jax.Array,
    local_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: ExpertActivation = SILU,
) -> jax.Array:
    """The backend entry point (signature: ``experts.ExpertCompute``) -> float32 [T, H].

    x [T, H]; local_ids / topk_weights [T, k] (rows of this device's stacked weights, or
    ``E_l`` for experts held elsewhere); w_gate, w_up [E_l, H, I]; w_down [E_l, I, H].
    The routing weight is applied in float32 to the float32 down projection; the sum over
    the k experts of a token is in a fixed order (deterministic, no scatter-add).
    """
    num_tokens, top_k = local_ids.shape
    num_rows = w_gate.shape[0]
    order, weight, inverse, group_sizes = sorted_assignments(local_ids, topk_weights, num_rows)
    xs = jnp.take(x, order // top_k, axis=0)  # [M, H]: token row of each sorted assignment

    def grouped(lhs: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)

    act = activation(grouped(xs, w_gate), grouped(xs, w_up)).astype(x.dtype)
    down = grouped(act, w_down)  # [M, H] float32
    local = jnp.arange(order.shape[0]) < jnp.sum(group_sizes)  # rows inside some group
    rows = jnp.where(local[:, None], down * weight[:, None], 0.0)
    # Back to [T, k] order through the inverse permutation, then the per-token sum.
    return jnp.take(rows, inverse, axis=0).reshape(num_tokens, top_k, -1).sum(axis=1)
