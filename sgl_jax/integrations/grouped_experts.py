"""Sparse SwiGLU experts for a trainer's forward: each token computed by its k experts only.

``grouped_swiglu(x, ids, weights, w_gate, w_up, w_down)`` = for every token n,
``sum_j weights[n, j] * down_e(silu(x[n] @ gate_e) * (x[n] @ up_e))`` with ``e = ids[n, j]``.
Pure JAX, differentiable in ``x``, ``weights`` and the expert weights (not in ``ids``), static
shapes whatever the routing (nothing recompiles when the routing changes), one program per
layer whatever the expert count: a model with 128 experts compiles like one with 8 (tunix
0.1.7's CPU path writes one block per expert per layer: minutes to compile at 48 x 128).

Two ways to compute the ``M = N * k`` token-expert assignments, both sorting them by expert:

- ``"tiles"`` (CPU default): each expert's rows padded to a multiple of ``tile_rows``, so every
  tile of rows belongs to one expert; the tiles are one batched matmul against their experts'
  weights gathered per tile. FLOPs ``2 * 3 * (M + E * (tile_rows - 1)) * H * I`` at most. On
  CPU this is the fast one: JAX lowers ``ragged_dot`` there to a dense dot over an
  expert-masked ``[E, M, H]`` copy of the rows (docs/moe_backends.md), ``E`` times the work.
  It materialises the gathered weights (``tiles * H * I`` per projection): fine at the widths
  a CPU runs, not at a real model's.
- ``"ragged"`` (TPU/GPU default): the engine's ragged backend (``jax.lax.ragged_dot`` grouped
  matmuls, ``sgl_jax.srt.layers.moe.ragged``), a grouped GEMM on TPU.

Ids must be in ``[0, E)`` and distinct within a token (the engine's and a router's top-k are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.layers.moe.ragged import ragged_experts

METHODS = ("auto", "tiles", "ragged")


def grouped_swiglu(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    method: str = "auto",
    tile_rows: int | None = None,
) -> jax.Array:
    """x [N, H]; ids [N, k] int; weights [N, k]; w_gate, w_up [E, H, I]; w_down [E, I, H]
    -> float32 [N, H]. Matmuls in x's dtype, accumulated and weighted in float32.

    ``tile_rows`` (``"tiles"`` only): None picks the largest power of two not above the mean
    rows per expert ``N * k / E``, within [8, 128]: tiles about as tall as an expert's group,
    so padding stays under half the rows while the tile count (the weights gathered) stays
    near ``E``."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}: use one of {METHODS}")
    if method == "auto":
        method = "tiles" if jax.devices()[0].platform == "cpu" else "ragged"
    if method == "ragged":
        return ragged_experts(x, ids, weights, w_gate, w_up, w_down)
    if tile_rows is None:
        mean_rows = ids.size / w_gate.shape[0]
        tile_rows = 1 << max(3, min(7, int(mean_rows).bit_length() - 1))
    return _tiled_experts(x, ids, weights, w_gate, w_up, w_down, tile_rows)


def _tiled_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, tile: int) -> jax.Array:
    num_tokens, top_k = ids.shape
    num_experts, hidden = w_gate.shape[0], x.shape[1]
    flat = ids.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, token order within
    expert_of_row = flat[order]
    sizes = jnp.bincount(flat, length=num_experts)
    tiles_of = (sizes + tile - 1) // tile
    first_tile = jnp.cumsum(tiles_of) - tiles_of
    first_row = jnp.cumsum(sizes) - sizes
    # sum(ceil(size / tile)) <= (m + E * (tile - 1)) / tile: a static bound on the tiles used.
    num_tiles = (m + num_experts * (tile - 1)) // tile
    # Sorted row r of expert e goes to padded row first_tile[e] * tile + (r - first_row[e]).
    padded_row = (first_tile[expert_of_row] * tile + jnp.arange(m, dtype=jnp.int32)
                  - first_row[expert_of_row])
    rows = jnp.take(x, order // top_k, axis=0)
    tiles = (jnp.zeros((num_tiles * tile, hidden), x.dtype)
             .at[padded_row].set(rows, unique_indices=True)
             .reshape(num_tiles, tile, hidden))
    # Tile t belongs to the expert whose tile range holds t; unused tiles (zeros) to the last.
    tile_expert = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(tiles_of), jnp.arange(num_tiles), side="right"),
        num_experts - 1)
    gate = jnp.einsum("trh,thi->tri", tiles, jnp.take(w_gate, tile_expert, axis=0))
    up = jnp.einsum("trh,thi->tri", tiles, jnp.take(w_up, tile_expert, axis=0))
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    down = jnp.einsum("tri,tih->trh", act, jnp.take(w_down, tile_expert, axis=0),
                      preferred_element_type=jnp.float32).reshape(num_tiles * tile, hidden)
    # Back to [token, slot] order: assignment a was sorted to position inverse[a].
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=order.dtype),
                                                  unique_indices=True)
    per_slot = jnp.take(down, jnp.take(padded_row, inverse), axis=0)
    per_slot = per_slot.reshape(num_tokens, top_k, hidden)
    return jnp.sum(per_slot * weights.astype(jnp.float32)[..., None], axis=1)
