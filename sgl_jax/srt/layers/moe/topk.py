"""Router: float32 softmax over the experts, then top-k in descending weight (ties -> lower id)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_experts(
    router_logits: jax.Array, top_k: int, renormalize: bool
) -> tuple[jax.Array, jax.Array]:
    """router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32).

    ``lax.top_k`` returns equal values in index order, which is the tie rule of the contract.
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)
