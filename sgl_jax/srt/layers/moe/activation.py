"""The activation between an expert's gate/up and down projections, as data of the step.

- ``silu`` (every family but gpt-oss): ``silu(gate) * up``.
- ``clamped_swiglu`` (gpt-oss): gate clamped from above at ``limit``, up on both sides, then
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

A frozen (hashable) dataclass: the expert backends take it as a static of the compiled step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"  # "silu" or "clamped_swiglu"
    limit: float = 0.0  # clamped_swiglu: swiglu_limit
    alpha: float = 1.702  # clamped_swiglu: swiglu_alpha

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(self.alpha * gate)


SILU = ExpertActivation()
