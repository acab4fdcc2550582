"""Rotary position embedding, non-interleaved ("rotate half") as in Qwen / Llama."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x: [T, heads, head_dim]; positions: [T]. Angles are computed in float32."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : head_dim // 2], x32[..., head_dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
