"""Rotary position embedding: full or partial, half-split or interleaved pairs, optional YaRN.

``rotary_dim`` leading dims of a head rotate (GLM-4.5 rotates half of each head, the rest
passes unchanged). Pairs are dims ``(i, i + rotary_dim/2)`` ("rotate half", Qwen / Llama /
Mixtral / GLM-4.5) or ``(2i, 2i+1)`` (``interleaved``: DeepSeek-V3's ``rope_interleave``); pair
``i`` turns by ``position * inv_freq[i]``. YaRN (DeepSeek-V3's ``rope_scaling``) changes the
frequencies and scales cos and sin (gpt-oss's too, with ``truncate`` false). Angles and rotation
are computed in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax.srt.configs.rope_scaling import RopeScaling


def inv_frequencies(rotary_dim: int, theta: float, yarn: RopeScaling | None = None) -> np.ndarray:
    """``[rotary_dim / 2]`` float64 inverse frequencies (static: computed at trace time)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    if yarn is None:
        return inv_freq
    # YaRN: dims that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those that turn more than beta_fast times keep their
    # frequency, and a linear ramp blends the two in between.
    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(yarn.original_max_position_embeddings
                                      / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:  # whole dims (transformers' default; gpt-oss keeps the fractions)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp
    return inv_freq / yarn.factor * (1 - extrapolate) + inv_freq * extrapolate


def _cos_sin(positions: jax.Array, theta: float, rotary_dim: int,
             yarn: RopeScaling | None) -> tuple[jax.Array, jax.Array]:
    """float32 ``[T, rotary_dim / 2]`` cos and sin of each pair's angle (YaRN-scaled)."""
    inv_freq = jnp.asarray(inv_frequencies(rotary_dim, theta, yarn), jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    scale = 1.0 if yarn is None else yarn.attention_factor
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rotation_table(positions: jax.Array, theta: float, rotary_dim: int,
                   yarn: RopeScaling | None = None) -> jax.Array:
    """float32 ``[T, rotary_dim]``: ``[cos | sin]`` of each "rotate half" pair's angle, the
    values :func:`apply_rotary` multiplies by, in one lane-wide row per token
    (``layers/norm_rope.py`` expands it to ``[cos, cos]`` and ``[-sin, sin]`` in VMEM)."""
    return jnp.concatenate(_cos_sin(positions, theta, rotary_dim, yarn), axis=-1)


def apply_rotary(
    x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None,
    interleaved: bool = False, yarn: RopeScaling | None = None,
) -> jax.Array:
    """x: [T, heads, head_dim]; positions: [T]. The first ``rotary_dim`` dims rotate."""
    head_dim = x.shape[-1]
    rot = rotary_dim or head_dim
    cos, sin = (a[:, None, :] for a in _cos_sin(positions, theta, rot, yarn))  # [T, 1, rot/2]
    x32 = x.astype(jnp.float32)
    part, rest = x32[..., :rot], x32[..., rot:]
    if interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        turned = turned.reshape(part.shape)
    else:
        x1, x2 = part[..., : rot // 2], part[..., rot // 2 :]
        turned = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    out = jnp.concatenate([turned, rest], axis=-1) if rot < head_dim else turned
    return out.astype(x.dtype)
