"""Expert computation for the sparse MoE block.

Every expert is applied to every token and the results are combined with a dense
``[tokens, experts]`` weight matrix that is zero outside each token's top-k. On a CPU and
with the small expert sizes this engine is tested with, this is as fast as gathering
per-token expert weights and has no data-dependent shapes; with the expert axis sharded
over a mesh it becomes each device computing its own experts followed by one all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def combine_weights(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int) -> jax.Array:
    """[T, k] ids and weights -> [T, E] float32 weights (0 for experts not chosen)."""
    one_hot = jax.nn.one_hot(topk_ids, num_experts, dtype=jnp.float32)  # [T, k, E]
    return jnp.einsum("tke,tk->te", one_hot, topk_weights.astype(jnp.float32))


def experts_forward(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    weights: jax.Array,
) -> jax.Array:
    """x [T, H]; w_gate, w_up [E, H, I]; w_down [E, I, H]; weights [T, E] -> [T, H]."""
    gate = jnp.einsum("th,ehi->tei", x, w_gate)
    up = jnp.einsum("th,ehi->tei", x, w_up)
    act = jax.nn.silu(gate) * up * weights[:, :, None].astype(x.dtype)
    return jnp.einsum("tei,eih->th", act, w_down)
