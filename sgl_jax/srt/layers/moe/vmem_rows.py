"""Row gathers of the gmm dispatch done in VMEM (Pallas TPU kernels).

XLA:TPU gathers single rows of a tiled ``[N, D]`` array a tile at a time: a bfloat16 row is
one of the 16 rows of a ``(16, 128)`` tile, and XLA's gather reads (and its cost analysis
counts) whole tiles; the tile-shaped view of ``gmm.take_tiled`` moves whole tiles per row but
costs a relayout of its operand or result on each side. A row gather is separable by columns,
so a kernel can hold the operand in VMEM a column block at a time (the whole width at decode;
256 or 128 of ``H`` columns at prefill, :func:`column_block`), read it from HBM once and pick
the rows there while the result streams out in row blocks:

- :func:`gather_rows`: ``x[idx]`` -> ``[M_pad, H]`` in ``x``'s dtype, in the row-major
  layout the gmm kernel reads (no relayout); rows past ``len(idx)`` hold row 0.
- :func:`sum_rows`: for each token ``t``, ``sum_j rows[index[t, j]]`` over the ``j`` with
  ``held[t, j]`` -> float32 ``[T, D]``; rows not held are never read (``where``, not a
  multiply: they may be garbage, even NaN). The sum runs over ``j = 0 .. k-1`` in order.
  It holds the ``[T * k, D]`` rows: decode.
- :func:`add_rows`: the same sums in scatter form, for when the rows are too many to hold
  (prefill) but the float32 ``[T, D]`` sums are not: the sums' column block stays in VMEM
  while the rows stream in, each added at its token (or skipped: code -1), in row order.

The gathering kernels copy the operand block, read from HBM once, into a float32 VMEM
scratch at the block's first row step (exact for any narrower float dtype) and load each row
with a dynamic sublane offset there (Mosaic cannot load a single row of a packed bfloat16
ref at an offset it cannot prove aligned; it can for 32-bit refs): ``cb / 128`` vector loads
per row and column block, the kernels' own work (not measured: no TPU here). Their cost
estimates are what they move: the operand once, the result once, the indices.

:func:`fits` / :func:`fits_sums` say whether 128 columns of the held array fit
``HELD_BUDGET`` and the indices ``MAX_INDICES``; the callers fall back to XLA's gathers
otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.layers.moe.manual_axes import mark_varying, varying_axes

BLOCK = 16  # rows of a bfloat16 (16, 128) tile; also a multiple of float32's 8
LANE = 128
# VMEM of the block a kernel holds across its grid steps: a column block of the gathered
# operand (two pipeline buffers and its float32 copy) or of the float32 sums (two buffers).
HELD_BUDGET = 16 * 1024 * 1024
# Scoped VMEM of a kernel: the held block (<= 16 MiB), two output or input row blocks
# (<= 1 MiB each) and Mosaic's own scratch; below the 95 / 128 MiB of v5p / v5e / v6e.
VMEM_LIMIT = 40 * 1024 * 1024
OUT_ROWS = 64  # rows of one streamed block (a grid step)
# Indices a kernel prefetches to SMEM (int32): 512 KiB, the most compiled (v6e, a 16,384-token
# prefill of the 30B at k = 8: 131,072 assignment rows); more fall back to XLA's gathers.
MAX_INDICES = 131_072


def lane_tiles(dim: int) -> list[int]:
    """Block sizes along a lane (minor) dimension a Mosaic kernel accepts: the whole
    dimension, and every multiple of 128 that divides it (largest first)."""
    return [dim] + [t for t in range(dim - dim % LANE, 0, -LANE) if t != dim and dim % t == 0]


def column_block(rows: int, width: int, bytes_per_element: int) -> int | None:
    """The widest column block of a held ``[rows, width]`` array (:func:`lane_tiles`) within
    ``HELD_BUDGET`` at ``bytes_per_element`` of VMEM per element; None: not even 128 columns
    fit (the callers fall back to XLA's gathers)."""
    rows = -(-rows // BLOCK) * BLOCK
    return next((c for c in lane_tiles(width) if rows * c * bytes_per_element <= HELD_BUDGET),
                None)


def held_bytes(itemsize: int) -> int:
    """VMEM per element of a held operand column block: two buffers and a float32 copy."""
    return 2 * itemsize + 4


def fits(rows: int, width: int, itemsize: int, indices: int) -> bool:
    """Whether :func:`gather_rows` / :func:`sum_rows` can hold a ``[rows, width]`` operand a
    column block at a time, with ``indices`` row indices in SMEM."""
    return (itemsize <= 4 and indices <= MAX_INDICES
            and column_block(rows, width, held_bytes(itemsize)) is not None)


def fits_sums(tokens: int, width: int, indices: int) -> bool:
    """Whether :func:`add_rows` can hold the float32 ``[tokens, width]`` sums a column block
    at a time, with ``indices`` row tokens in SMEM."""
    return indices <= MAX_INDICES and column_block(tokens, width, 8) is not None


def _widen(src_ref, f32_ref) -> None:
    """At the first row step of a column block, the float32 copy of the held operand block
    (kept across the block's row steps: the grid runs in order on one core, ``arbitrary``)."""
    @pl.when(pl.program_id(1) == 0)
    def _():
        f32_ref[...] = src_ref[...].astype(jnp.float32)


def _gather_kernel(idx_ref, x_ref, o_ref, xf_ref):
    _widen(x_ref, xf_ref)
    base = pl.program_id(1) * o_ref.shape[0]

    def block(b, carry):
        first = base + b * BLOCK
        rows = [xf_ref[pl.ds(idx_ref[first + r], 1), :] for r in range(BLOCK)]
        start = pl.multiple_of(b * BLOCK, BLOCK)
        o_ref[pl.ds(start, BLOCK), :] = jnp.concatenate(rows, axis=0).astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, o_ref.shape[0] // BLOCK, block, 0)


def _sum_kernel(top_k, code_ref, rows_ref, o_ref, rf_ref):
    _widen(rows_ref, rf_ref)
    base = pl.program_id(1) * o_ref.shape[0]

    def block(b, carry):
        out = []
        for r in range(BLOCK):
            token = base + b * BLOCK + r
            acc = jnp.zeros((1, o_ref.shape[1]), jnp.float32)
            for j in range(top_k):
                code = code_ref[token * top_k + j]  # row index, or -1: not held
                row = rf_ref[pl.ds(jnp.maximum(code, 0), 1), :]
                acc = acc + jnp.where(code >= 0, row, jnp.zeros_like(row))
            out.append(acc)
        start = pl.multiple_of(b * BLOCK, BLOCK)
        o_ref[pl.ds(start, BLOCK), :] = jnp.concatenate(out, axis=0)
        return carry

    jax.lax.fori_loop(0, o_ref.shape[0] // BLOCK, block, 0)


def _add_kernel(code_ref, rows_ref, o_ref):
    """Streams ``BLOCK``-row groups of a row block and adds each row into the held float32
    sums at its token (``code``; -1: skipped), in row order."""
    @pl.when(pl.program_id(1) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    base = pl.program_id(1) * rows_ref.shape[0]

    def block(b, carry):
        start = pl.multiple_of(b * BLOCK, BLOCK)
        group = rows_ref[pl.ds(start, BLOCK), :].astype(jnp.float32)
        for r in range(BLOCK):
            code = code_ref[base + b * BLOCK + r]
            target = jnp.maximum(code, 0)
            row = o_ref[pl.ds(target, 1), :]
            o_ref[pl.ds(target, 1), :] = row + jnp.where(code >= 0, group[r:r + 1],
                                                          jnp.zeros_like(row))
        return carry

    jax.lax.fori_loop(0, rows_ref.shape[0] // BLOCK, block, 0)


def _manual(*arrays: jax.Array) -> bool:
    """Whether any operand varies over a manual mesh axis (inside ``shard_map``). Pallas's
    interpret mode (CPU) cannot run these kernels there (its grid loop's carry changes its
    varying axes); off TPU they are then computed with the same arithmetic in jnp. On TPU
    the kernels run under ``shard_map`` (the engine's MoE layer)."""
    return bool(varying_axes(*arrays))


def _row_block(rows: int) -> int:
    block = min(OUT_ROWS, rows)
    while rows % block:
        block //= 2
    return block


def _call(kernel: Callable[..., None], scalars: jax.Array, operand: jax.Array,
          out_shape: jax.ShapeDtypeStruct, grid: tuple[int, int], in_spec: pl.BlockSpec,
          out_spec: pl.BlockSpec, scratch: list[Any], cost: pl.CostEstimate,
          interpret: bool) -> jax.Array:
    """``kernel(scalars_ref, operand_ref, out_ref, *scratch_refs)`` over a (column block, row
    block) grid run in order on one core (a held block is reused across the row steps),
    ``scalars`` prefetched to SMEM; traced with ``shard_map``'s check_vma off, the output
    then marked varying (manual_axes.py)."""
    with jax_config._check_vma(False):
        out = pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=grid, in_specs=[in_spec], out_specs=out_spec,
                scratch_shapes=scratch),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(scalars, operand)
    return mark_varying(out, scalars, operand)


def _gather_call(kernel: Callable[..., None], scalars: jax.Array, operand: jax.Array,
                 rows: int, dtype: Any, cost: pl.CostEstimate, interpret: bool) -> jax.Array:
    """A ``[rows, D]`` output of ``dtype`` picked from ``operand`` [N, D]: for each column
    block (:func:`column_block`) the operand's ``[N, cb]`` block is held in VMEM with its
    float32 copy while the output's row blocks (at most ``OUT_ROWS``) stream out."""
    n, width = operand.shape
    cols = column_block(n, width, held_bytes(operand.dtype.itemsize))
    block = _row_block(rows)
    return _call(kernel, scalars, operand, jax.ShapeDtypeStruct((rows, width), dtype),
                 (width // cols, rows // block),
                 pl.BlockSpec((n, cols), lambda c, i, _: (0, c)),
                 pl.BlockSpec((block, cols), lambda c, i, _: (i, c)),
                 [pltpu.VMEM((n, cols), jnp.float32)], cost, interpret)


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def gather_rows(x: jax.Array, idx: jax.Array, rows: int, interpret: bool) -> jax.Array:
    """``x[idx]`` ([N, D] by [M] indices in bounds) -> ``[rows, D]``, ``rows`` >= M a multiple
    of 16; rows past M hold ``x[0]``."""
    n, d = x.shape
    if rows % BLOCK or rows < idx.shape[0]:
        raise ValueError(f"{rows} rows: not a multiple of {BLOCK} or fewer than the indices")
    n_pad = -(-n // BLOCK) * BLOCK
    x = jnp.pad(x, ((0, n_pad - n), (0, 0))) if n_pad != n else x
    idx = jnp.pad(idx.astype(jnp.int32), (0, rows - idx.shape[0]))
    if interpret and _manual(x, idx):
        return jnp.take(x, idx, axis=0)  # the kernel's result (see _manual)
    cost = pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=(n_pad + rows) * d
                           * x.dtype.itemsize + rows * 4)
    return _gather_call(_gather_kernel, idx, x, rows, x.dtype, cost, interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sum_rows(rows: jax.Array, index: jax.Array, held: jax.Array, interpret: bool) -> jax.Array:
    """float32 ``[T, D]``: ``sum_j where(held[t, j], rows[index[t, j]], 0)`` of ``rows``
    ([M, D], any float dtype), j in order; rows not held are never read."""
    m, d = rows.shape
    tokens, top_k = index.shape
    m_pad = -(-m // BLOCK) * BLOCK
    rows = jnp.pad(rows, ((0, m_pad - m), (0, 0))) if m_pad != m else rows
    t_pad = -(-tokens // BLOCK) * BLOCK
    code = jnp.where(held, index, -1).astype(jnp.int32)
    code = jnp.pad(code, ((0, t_pad - tokens), (0, 0)), constant_values=-1).reshape(-1)
    if interpret and _manual(rows, code):  # the kernel's arithmetic (see _manual)
        codes = code.reshape(t_pad, top_k)
        out = jnp.zeros((t_pad, d), jnp.float32)
        for j in range(top_k):
            row = jnp.take(rows, jnp.maximum(codes[:, j], 0), axis=0).astype(jnp.float32)
            out = out + jnp.where(codes[:, j:j + 1] >= 0, row, jnp.zeros_like(row))
        return out[:tokens]
    cost = pl.CostEstimate(flops=tokens * top_k * d, transcendentals=0,
                           bytes_accessed=m_pad * d * rows.dtype.itemsize + t_pad * d * 4
                           + code.size * 4)
    out = _gather_call(functools.partial(_sum_kernel, top_k), code, rows, t_pad, jnp.float32,
                       cost, interpret)
    return out[:tokens] if t_pad != tokens else out


@functools.partial(jax.jit, static_argnames=("tokens", "interpret"))
def add_rows(rows: jax.Array, token: jax.Array, tokens: int, interpret: bool) -> jax.Array:
    """float32 ``[tokens, D]``: each row of ``rows`` ([M, D], any float dtype) added to the
    sum of its token ``token[m]`` ([M]; -1: a row to skip, never read into a sum: it may be
    garbage), rows in order. The scatter form of :func:`sum_rows`, for when the rows are too
    many to hold (prefill) but the sums are not (:func:`fits_sums`)."""
    m, d = rows.shape
    m_pad = -(-m // BLOCK) * BLOCK
    rows = jnp.pad(rows, ((0, m_pad - m), (0, 0))) if m_pad != m else rows
    code = jnp.pad(token.astype(jnp.int32), (0, m_pad - m), constant_values=-1)
    t_pad = -(-tokens // BLOCK) * BLOCK
    if interpret and _manual(rows, code):  # the kernel's arithmetic (see _manual)
        kept = jnp.where(code[:, None] >= 0, rows.astype(jnp.float32), 0.0)
        return jnp.zeros((tokens, d), jnp.float32).at[jnp.maximum(code, 0)].add(kept)
    cols = column_block(t_pad, d, 8)
    if cols is None:
        raise ValueError(f"{tokens} x {d} float32 sums do not fit {HELD_BUDGET} bytes of VMEM")
    block = _row_block(m_pad)
    cost = pl.CostEstimate(flops=m * d, transcendentals=0,
                           bytes_accessed=m_pad * d * rows.dtype.itemsize + t_pad * d * 4
                           + m_pad * 4)
    out = _call(_add_kernel, code, rows, jax.ShapeDtypeStruct((t_pad, d), jnp.float32),
                (d // cols, m_pad // block),
                pl.BlockSpec((block, cols), lambda c, i, _: (i, c)),
                pl.BlockSpec((t_pad, cols), lambda c, i, _: (0, c)), [], cost, interpret)
    return out[:tokens] if t_pad != tokens else out
