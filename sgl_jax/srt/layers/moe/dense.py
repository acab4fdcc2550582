"""The ``dense`` expert backend: every expert applied to every token.

Every expert is applied to every token and the results are combined with a dense
``[tokens, experts]`` weight matrix that is zero outside each token's top-k. It costs
``2 * 3 * T * E * H * I`` FLOPs (gate, up and down projections of all E experts), has no
data-dependent shapes and no gather, and is the reference the ``ragged`` backend is tested
against. On a CPU, with the small expert sizes this engine is tested with, it is the fastest
choice (``docs/moe_backends.md``). Under expert parallelism (``ep_moe.py``) each device runs it
on its own experts with its own columns of the matrix and one all-reduce adds the results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.moe.activation import SILU, ExpertActivation


def combine_weights(
    topk_ids: jax.Array, topk_weights: jax.Array, expert_ids: jax.Array
) -> jax.Array:
    """[T, k] ids and weights -> [T, len(expert_ids)] float32 combine weights.

    Column j belongs to expert ``expert_ids[j]``: it holds the token's routing weight for that
    expert, or 0 if the expert is not in the token's top-k. A token's top-k ids are distinct,
    so at most one term of each sum is non-zero and the weights are copied exactly (a select
    and a sum of zeros, not a matmul, whose precision depends on the backend). An id that
    matches no column (an expert held by another device) contributes nothing.
    """
    hit = topk_ids[:, :, None] == expert_ids[None, None, :]  # [T, k, E']
    w = topk_weights.astype(jnp.float32)[:, :, None]
    return jnp.sum(jnp.where(hit, w, 0.0), axis=1)


def experts_forward(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
    activation: ExpertActivation = SILU,
) -> jax.Array:
    """x [T, H]; w_gate, w_up [E, H, I]; w_down [E, I, H]; weights [T, E] -> float32 [T, H].

    The result is float32 whatever the weights' dtype, so that partial sums of several
    devices are added at full precision; callers cast it back to the activation dtype.
    """
    gate = jnp.einsum("th,ehi->tei", x, w_gate)
    up = jnp.einsum("th,ehi->tei", x, w_up)
    act = activation(gate, up) * weights[:, :, None].astype(x.dtype)
    return jnp.einsum("tei,eih->th", act, w_down, preferred_element_type=jnp.float32)


def dense_experts(
    x: jax.Array,
    local_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    activation: ExpertActivation = SILU,
) -> jax.Array:
    """The backend entry point (signature: ``experts.ExpertCompute``) -> float32 [T, H].

    ``local_ids`` [T, k] are rows of this device's stacked weights, or ``E_l`` (= number of
    rows) for an expert held by another device. Column j of the combine weights is row j, so
    the weights are exactly those the logical ids and the device's mapping row give.
    """
    rows = jnp.arange(w_gate.shape[0], dtype=local_ids.dtype)
    weights = combine_weights(local_ids, topk_weights, rows)
    return experts_forward(x, w_gate, w_up, w_down, weights, activation)
