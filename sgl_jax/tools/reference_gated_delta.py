"""Float64 numpy reference of Qwen3.5's Gated DeltaNet (linear attention) layer, written from
its definition; shares no code with ``sgl_jax.srt``.

For a token t (all per value head h; key head h // (Hv / Hk) serves value head h):

    [q | k | v]_t = silu(causal depthwise conv1d over the last K inputs of in_proj_qkv(x))
    q = l2norm(q) / sqrt(dk), k = l2norm(k)          l2norm(u) = u / sqrt(sum u^2 + 1e-6)
    beta = sigmoid(in_proj_b(x)), g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    S = exp(g) * S;  S += k (beta (v - k^T S))^T;  o = q^T S          S: [dk, dv]
    y = out_proj(rmsnorm(o) * norm.weight * silu(in_proj_z(x)))      (per head, eps rms_norm_eps)

Two states persist per request: the conv state (the last K - 1 conv inputs, [conv_dim, K-1],
oldest first) and the recurrent state S ([Hv, dk, dv]); zeros at the start of a request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


@dataclass
class GatedDeltaWeights:
    """One layer's tensors in transformers' orientation ([out, in] for projections)."""

    in_proj_qkv: np.ndarray  # [2 Hk dk + Hv dv, hidden]
    in_proj_z: np.ndarray  # [Hv dv, hidden]
    in_proj_b: np.ndarray  # [Hv, hidden]
    in_proj_a: np.ndarray  # [Hv, hidden]
    conv1d: np.ndarray  # [conv_dim, K] (transformers: [conv_dim, 1, K])
    dt_bias: np.ndarray  # [Hv]
    A_log: np.ndarray  # [Hv]
    norm: np.ndarray  # [dv]
    out_proj: np.ndarray  # [hidden, Hv dv]
    num_key_heads: int
    key_dim: int  # dk
    value_dim: int  # dv
    eps: float

    @property
    def num_value_heads(self) -> int:
        return self.A_log.shape[0]


def causal_conv(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """silu(depthwise causal conv) of x [T, C] preceded by ``state`` [C, K-1] (earlier inputs,
    oldest first): out[t, c] = sum_j weight[c, j] * u[t + j, c] over u = state ++ x, so the
    last tap weighs the current input. Returns (out [T, C], new state [C, K-1])."""
    kernel = weight.shape[1]
    u = np.concatenate([state.T, x], axis=0)  # [K-1+T, C]
    out = np.zeros_like(x)
    for j in range(kernel):
        out += weight[:, j][None, :] * u[j: j + x.shape[0]]
    return silu(out), u[u.shape[0] - (kernel - 1):].T.copy()


def gated_delta_recurrence(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
    state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, token by token. q, k [T, H, dk] (already normalised and scaled),
    v [T, H, dv], g and beta [T, H], state [H, dk, dv]. Returns (o [T, H, dv], final state)."""
    s = state.copy()
    out = np.zeros_like(v)
    for t in range(q.shape[0]):
        s *= np.exp(g[t])[:, None, None]
        remembered = np.einsum("hk,hkv->hv", k[t], s)
        delta = beta[t][:, None] * (v[t] - remembered)
        s += np.einsum("hk,hv->hkv", k[t], delta)
        out[t] = np.einsum("hk,hkv->hv", q[t], s)
    return out, s


def gated_delta_layer(
    x: np.ndarray, w: GatedDeltaWeights, conv_state: np.ndarray | None = None,
    recurrent_state: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer on x [T, hidden] (after the input norm) from the given states (None: zeros,
    a new request). Returns (y [T, hidden], conv_state [C, K-1], recurrent_state [Hv, dk, dv])."""
    hk, dk, dv, hv = w.num_key_heads, w.key_dim, w.value_dim, w.num_value_heads
    conv_dim, kernel = w.conv1d.shape
    if conv_state is None:
        conv_state = np.zeros((conv_dim, kernel - 1))
    if recurrent_state is None:
        recurrent_state = np.zeros((hv, dk, dv))
    t = x.shape[0]
    mixed, conv_state = causal_conv(x @ w.in_proj_qkv.T, w.conv1d, conv_state)
    q = mixed[:, : hk * dk].reshape(t, hk, dk)
    k = mixed[:, hk * dk: 2 * hk * dk].reshape(t, hk, dk)
    v = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
    q = np.repeat(l2norm(q), hv // hk, axis=1) / np.sqrt(dk)
    k = np.repeat(l2norm(k), hv // hk, axis=1)
    beta = sigmoid(x @ w.in_proj_b.T)
    g = -np.exp(w.A_log) * softplus(x @ w.in_proj_a.T + w.dt_bias)
    o, recurrent_state = gated_delta_recurrence(q, k, v, g, beta, recurrent_state)
    z = (x @ w.in_proj_z.T).reshape(t, hv, dv)
    normed = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + w.eps) * w.norm * silu(z)
    return normed.reshape(t, hv * dv) @ w.out_proj.T, conv_state, recurrent_state
