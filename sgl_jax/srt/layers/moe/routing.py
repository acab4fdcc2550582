"""The routing a step outputs: every token's top-k experts in every layer, stacked once.

The decoder's layer loop returns each MoE layer's router choice as a value (never a write into
a Python object while traced); ``stack_routing`` stacks them once into a ``Routing``, a pytree
leaf of the jitted step's output. Its consumers read it there: the routed-experts capturer
(``routed_experts_capturer.py``: the rows of the host table) and the expert-distribution
recorder (``expert_distribution.py``: counts or ids).

What the step outputs is chosen once, when the runner is built (``RoutingSpec``): with nothing
asked (no capture, no recorder), no routing value is built and the step's program is the one
it would be without this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from sgl_jax.srt.mem_cache.routed_experts_host_cache import NO_ROUTER

# One layer's router choice: (top-k ids [T, >= k] int, routing weights [T, >= k] float), or
# None for a layer without a router (a dense MLP).
LayerRouting = tuple[jax.Array, jax.Array] | None


@dataclass(frozen=True)
class RoutingSpec:
    """What routing the step outputs: nothing (the default), the top-k ids, or the ids and
    their routing weights. The union of what its consumers need (``|``)."""

    ids: bool = False
    weights: bool = False

    def __or__(self, other: RoutingSpec) -> RoutingSpec:
        return RoutingSpec(self.ids or other.ids, self.weights or other.weights)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
    """A step's routing, token-major: ``ids [T, num_hidden_layers, k]`` (int32 with NO_ROUTER,
    -1, for layers without a router, as the model outputs it; the capturer casts them to its
    host table's dtype) and, when asked, ``weights`` of the same shape (float32, 0 for layers
    without a router)."""

    ids: jax.Array
    weights: jax.Array | None = None


def stack_routing(layers: list[LayerRouting], top_k: int, spec: RoutingSpec) -> Routing:
    """Traced: the layers' router choices as one ``Routing`` (their first ``top_k`` columns:
    fused shared-expert columns after the top-k are not routing). ``layers`` has one entry per
    decoder layer, at least one of them a router's."""
    num_tokens = next(r for r in layers if r is not None)[0].shape[0]
    no_router = jnp.full((num_tokens, top_k), NO_ROUTER, jnp.int32)
    ids = jnp.stack([no_router if r is None else r[0][:, :top_k].astype(jnp.int32)
                     for r in layers], axis=1)
    if not spec.weights:
        return Routing(ids)
    zero = jnp.zeros((num_tokens, top_k), jnp.float32)
    weights = jnp.stack([zero if r is None else r[1][:, :top_k].astype(jnp.float32)
                         for r in layers], axis=1)
    return Routing(ids, weights)
