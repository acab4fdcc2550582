"""RMSNorm, computed in float32 whatever the parameter dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype=dtype), out_sharding=(None,), eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class RMSNormPlusOne(RMSNorm):
    """RMSNorm computing ``x * (1 + w)`` (Qwen3.5-MoE's decoder, final and q/k norms). The
    parameter holds the checkpoint's ``w`` as is (initialised around 0), so loads and weight
    updates need no conversion."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, 1.0 + self.weight[...].astype(jnp.float32), self.eps)
