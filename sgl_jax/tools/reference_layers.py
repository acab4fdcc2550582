"""Float64 numpy building blocks of the reference forward (see sgl_jax.tools.reference_forward).

Part of the independent yardstick: shares no code with ``sgl_jax.srt``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "apply_rope",
    "causal_attention",
    "clamped_swiglu",
    "dequantize_mxfp4",
    "default_inv_freq",
    "rms_norm",
    "silu",
    "softmax",
    "swiglu",
    "yarn_get_mscale",
    "yarn_inv_freq",
]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)), weights in HF orientation [out, in]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def clamped_swiglu(
    x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, gate_bias: np.ndarray,
    up_bias: np.ndarray, down_bias: np.ndarray, limit: float, alpha: float,
) -> np.ndarray:
    """gpt-oss's expert: g = min(x gate^T + gb, limit), u = clip(x up^T + ub, -limit, limit),
    ((u + 1) * g * sigmoid(alpha * g)) down^T + db; weights [out, in]."""
    g = np.minimum(x @ gate.T + gate_bias, limit)
    u = np.clip(x @ up.T + up_bias, -limit, limit)
    return ((u + 1.0) * g / (1.0 + np.exp(-alpha * g))) @ down.T + down_bias


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling: E2M1 elements, one E8M0 exponent per 32): blocks [..., N, G,
    16] bytes of two 4-bit codes (low nibble first), scales [..., N, G] biased exponents ->
    [..., N, G * 32] float64. An E2M1 code is sign (bit 3), exponent (bits 2-1, bias 1) and
    one mantissa bit: subnormal 0.5 * m when the exponent field is 0."""
    codes = np.stack([blocks.astype(np.int64) & 15, blocks.astype(np.int64) >> 4], axis=-1)
    sign = np.where(codes >> 3, -1.0, 1.0)
    exp, mant = (codes >> 1) & 3, codes & 1
    magnitude = np.where(exp == 0, 0.5 * mant, (1.0 + 0.5 * mant) * 2.0 ** (exp - 1.0))
    values = sign * magnitude * 2.0 ** (scales.astype(np.int64) - 127.0)[..., None, None]
    return values.reshape(*values.shape[:-3], -1)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def default_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/rotary_dim), i < rotary_dim/2."""
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    rotary_dim: int, theta: float, params: dict, max_position_embeddings: int
) -> tuple[np.ndarray, float, float]:
    """YaRN frequencies as transformers' _compute_yarn_parameters defines them.

    Returns (inv_freq [rotary_dim/2], attention_factor multiplying cos and sin, factor).
    Extrapolated (original) frequencies below the correction range, interpolated
    (inv_freq / factor) above it, a linear ramp in between.
    """
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = default_inv_freq(rotary_dim, theta)
    interpolation = extrapolation / factor
    inv_freq = interpolation * ramp + extrapolation * (1.0 - ramp)
    return inv_freq, float(attention_factor), factor


def apply_rope(
    x: np.ndarray,
    positions: np.ndarray,
    theta: float = 1e4,
    *,
    inv_freq: np.ndarray | None = None,
    rotary_dim: int | None = None,
    interleave: bool = False,
    attention_factor: float = 1.0,
) -> np.ndarray:
    """RoPE on the first rotary_dim dims of x [T, heads, head_dim] at integer positions [T].

    Non-interleaved ("rotate_half"): dim i and i + rotary_dim/2 form one rotation pair with
    frequency inv_freq[i] (default theta^(-2i/rotary_dim)). interleave=True takes the pairs
    (2i, 2i+1) instead and returns them de-interleaved (rotated evens, then rotated odds), as
    transformers' DeepSeek-V3 does: q.k products are the same as interleaved output. cos and
    sin are multiplied by attention_factor (YaRN). Dims from rotary_dim on pass unchanged.
    """
    head_dim = x.shape[-1]
    if inv_freq is None:
        inv_freq = default_inv_freq(rotary_dim or head_dim, theta)
    rot = 2 * len(inv_freq)
    if rot > head_dim:
        raise ValueError(f"rotary dim {rot} exceeds head_dim {head_dim}")
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos = (np.cos(angles) * attention_factor)[:, None, :]  # broadcast over heads
    sin = (np.sin(angles) * attention_factor)[:, None, :]
    xr, rest = x[..., :rot], x[..., rot:]
    if interleave:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


# --------------------------------------------------------------------------------------------
# Attention core
# --------------------------------------------------------------------------------------------


def causal_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, q_positions: np.ndarray, scale: float,
    sliding_window: int | None = None, sinks: np.ndarray | None = None,
) -> np.ndarray:
    """softmax(q.k * scale) v with a causal mask; q [n, H, d], keys [S, Hkv, d], values
    [S, Hkv, dv] (key j sits at position j). Query head h reads kv head h // (H / Hkv).
    ``sliding_window`` w: a query at p sees keys p - w < j <= p only. ``sinks`` [H]: a logit
    per head appended to each row's scores before the softmax, its probability dropped.
    Returns [n, H, dv]."""
    group = q.shape[1] // keys.shape[1]
    keys = np.repeat(keys, group, axis=1)
    values = np.repeat(values, group, axis=1)
    scores = np.einsum("qhd,shd->hqs", q, keys) * scale
    key_pos = np.arange(keys.shape[0])
    hidden = key_pos[None, None, :] > q_positions[None, :, None]
    if sliding_window:
        hidden |= key_pos[None, None, :] <= q_positions[None, :, None] - sliding_window
    scores = np.where(hidden, -np.inf, scores)
    if sinks is None:
        return np.einsum("hqs,shd->qhd", softmax(scores, axis=-1), values)
    sink = np.broadcast_to(sinks[:, None, None], scores.shape[:2] + (1,))
    probs = softmax(np.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return np.einsum("hqs,shd->qhd", probs, values)
