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

(The un-permute of down's rows into per-token sums is down's own kernel: ``gmm_combine``.)
The kernel copies the operand block, read from HBM once, into a float32 VMEM
scratch at the block's first row step (exact for any narrower float dtype) and load each row
with a dynamic sublane offset there (Mosaic cannot load a single row of a packed bfloat16
ref at an offset it cannot prove aligned; it can for 32-bit refs): ``cb / 128`` vector loads
per row and column block, the kernel's own work (not measured: no TPU here). Its cost
estimate is what it moves: the operand once, the result once, the indices.

:func:`fits` says whether 128 columns of the held array fit ``HELD_BUDGET`` and the indices
``MAX_INDICES``; the callers fall back to XLA's gathers otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.layers.moe.manual_axes import mark_varying, varying_axes

BLOCK = 16  # rows of a bfloat16 (16, 128) tile; also a multiple of float32's 8
LANE = 128
# VMEM of the block a kernel holds across its grid steps: a column block of the gathered
# operand (two pipeline buffers and its float32 copy), or of gmm_combine's float32 sums (4
# bytes an element whatever the output dtype: 768 columns of 8,192 tokens).
HELD_BUDGET = 24 * 1024 * 1024
# Scoped VMEM a kernel may ask for (below the 64 / 128 / 128 MiB per TensorCore of v5p / v5e /
# v6e in JAX's table; v4 has 16: its compiler refuses more), and what the
# kernels size their blocks to within it (the held block, the streamed blocks, scratch and
# values), leaving the rest to Mosaic's own scratch.
VMEM_LIMIT = 40 * 1024 * 1024
KERNEL_BUDGET = 32 * 1024 * 1024
# The scoped VMEM the combine kernel asks for on chips with at least so much VMEM per
# TensorCore (``gmm_combine``: its held float32 sums are as wide as VMEM allows, and each
# column block of them reads the activations once more): 100 MiB of v5e's and v6e's 128,
# 48 MiB of v5p's 64 (the 235B's 8,192 tokens' sums 1,024 columns at a time, not 512).
# Largest first.
VMEM_TIERS = ((128 * 1024 * 1024, 100 * 1024 * 1024), (64 * 1024 * 1024, 48 * 1024 * 1024))
OUT_ROWS = 64  # rows of one streamed block (a grid step)
# Indices a kernel prefetches to SMEM (int32): 512 KiB, the most compiled (v6e, a 16,384-token
# prefill of the 30B at k = 8: 131,072 assignment rows); more fall back to XLA's gathers.
MAX_INDICES = 131_072


def vmem_limit(device_kind: str | None) -> int:
    """The scoped VMEM a kernel sized by :func:`budgets` may ask for on a chip of
    ``device_kind`` (``jax.Device.device_kind``, e.g. "TPU v6 lite"): the limit of the
    first of ``VMEM_TIERS`` whose VMEM per TensorCore the chip has, else ``VMEM_LIMIT``
    (also for a kind JAX's table does not know, or no TPU)."""
    return chip_vmem_limit(device_kind) or VMEM_LIMIT


def chip_vmem_limit(device_kind: str | None) -> int | None:
    """The limit of the first of ``VMEM_TIERS`` whose VMEM per TensorCore a chip of
    ``device_kind`` has; None for a smaller chip, a kind JAX's table does not know, or no
    TPU (a kernel then keeps XLA's default)."""
    if not device_kind:
        return None
    try:
        from jax._src.pallas.mosaic import tpu_info  # the kind's chip: not a public API yet

        version = tpu_info.chip_version_from_device_kind(device_kind)
        capacity = pltpu.get_tpu_info_for_chip(version, 1).vmem_capacity_bytes
    except Exception:  # noqa: BLE001 - an unknown or non-TPU kind
        return None
    return next((limit for vmem, limit in VMEM_TIERS if capacity >= vmem), None)


def budgets(limit: int = VMEM_LIMIT) -> tuple[int, int]:
    """(held block, whole kernel) VMEM budgets under a scoped limit of ``limit`` bytes: the
    defaults ``HELD_BUDGET`` and ``KERNEL_BUDGET``, the held block taking what a larger limit
    adds."""
    extra = max(limit - VMEM_LIMIT, 0)
    return HELD_BUDGET + extra, KERNEL_BUDGET + extra


def pad_block(rows: int) -> int:
    """``rows`` rounded up to a whole number of ``BLOCK``-row tiles."""
    return -(-rows // BLOCK) * BLOCK


def lane_tiles(dim: int) -> list[int]:
    """Block sizes along a lane (minor) dimension a Mosaic kernel accepts: the whole
    dimension, and every multiple of 128 that divides it (largest first)."""
    return [dim] + [t for t in range(dim - dim % LANE, 0, -LANE) if t != dim and dim % t == 0]


def column_block(rows: int, width: int, bytes_per_element: int) -> int | None:
    """The widest column block of a held ``[rows, width]`` array (:func:`lane_tiles`) within
    ``HELD_BUDGET`` at ``bytes_per_element`` of VMEM per element; None: not even 128 columns
    fit (the callers fall back to XLA's gathers)."""
    rows = pad_block(rows)
    return next((c for c in lane_tiles(width) if rows * c * bytes_per_element <= HELD_BUDGET),
                None)


def held_bytes(itemsize: int) -> int:
    """VMEM per element of a held operand column block: two buffers and a float32 copy."""
    return 2 * itemsize + 4


def fits(rows: int, width: int, itemsize: int, indices: int) -> bool:
    """Whether :func:`gather_rows` can hold a ``[rows, width]`` operand a column block at a
    time, with ``indices`` row indices in SMEM."""
    return (itemsize <= 4 and indices <= MAX_INDICES
            and column_block(rows, width, held_bytes(itemsize)) is not None)


def _gather_kernel(idx_ref, x_ref, o_ref, xf_ref):
    # At the first row step of a column block, the float32 copy of the held operand block
    # (kept across the block's row steps: the grid runs in order on one core, "arbitrary").
    @pl.when(pl.program_id(1) == 0)
    def _():
        xf_ref[...] = x_ref[...].astype(jnp.float32)

    pick_rows(xf_ref, idx_ref, pl.program_id(1) * o_ref.shape[0], o_ref)


def pick_rows(xf_ref, idx_ref, first, o_ref) -> None:
    """``o_ref[r] = xf_ref[idx_ref[first + r]]`` for every row r of ``o_ref`` (a multiple of
    ``BLOCK`` rows, any float dtype): picked from the float32 ``xf_ref`` by dynamic sublane
    offsets, stored ``BLOCK`` rows at a time (whole packed tiles)."""
    def block(b, carry):
        start = b * BLOCK
        rows = [xf_ref[pl.ds(idx_ref[first + start + r], 1), :] for r in range(BLOCK)]
        aligned = pl.multiple_of(start, BLOCK)
        o_ref[pl.ds(aligned, BLOCK), :] = jnp.concatenate(rows, axis=0).astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, o_ref.shape[0] // BLOCK, block, 0)


def under_manual_axes(*arrays: jax.Array) -> bool:
    """Whether any operand varies over a manual mesh axis (inside ``shard_map``). Pallas's
    interpret mode (CPU) cannot run a kernel with a held block there (its grid loop's carry
    changes its varying axes); off TPU the same arithmetic then runs in jnp. On TPU the
    kernels run under ``shard_map`` (the engine's MoE layer)."""
    return bool(varying_axes(*arrays))


def _row_block(rows: int) -> int:
    block = min(OUT_ROWS, rows)
    while rows % block:
        block //= 2
    return block


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def gather_rows(x: jax.Array, idx: jax.Array, rows: int, interpret: bool) -> jax.Array:
    """``x[idx]`` ([N, D] by [M] indices in bounds) -> ``[rows, D]``, ``rows`` >= M a multiple
    of 16; rows past M hold ``x[0]``.

    For each column block (:func:`column_block`) x's ``[N, cb]`` block is held in VMEM with
    its float32 copy while the output's row blocks (at most ``OUT_ROWS``) stream out; the
    grid (column block, row block) runs in order on one core, the indices in SMEM."""
    n, d = x.shape
    if rows % BLOCK or rows < idx.shape[0]:
        raise ValueError(f"{rows} rows: not a multiple of {BLOCK} or fewer than the indices")
    n_pad = pad_block(n)
    x = jnp.pad(x, ((0, n_pad - n), (0, 0))) if n_pad != n else x
    idx = jnp.pad(idx.astype(jnp.int32), (0, rows - idx.shape[0]))
    if interpret and under_manual_axes(x, idx):
        return jnp.take(x, idx, axis=0)  # the kernel's result (see under_manual_axes)
    cols = column_block(n_pad, d, held_bytes(x.dtype.itemsize))
    if cols is None:
        raise ValueError(f"a {n} x {d} operand does not fit {HELD_BUDGET} bytes of VMEM "
                         f"128 columns at a time")
    block = _row_block(rows)
    cost = pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=(n_pad + rows) * d
                           * x.dtype.itemsize + rows * 4)
    with jax_config._check_vma(False):
        out = pl.pallas_call(
            _gather_kernel,
            out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(d // cols, rows // block),
                in_specs=[pl.BlockSpec((n_pad, cols), lambda c, i, _: (0, c))],
                out_specs=pl.BlockSpec((block, cols), lambda c, i, _: (i, c)),
                scratch_shapes=[pltpu.VMEM((n_pad, cols), jnp.float32)]),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(idx, x)
    # Traced with shard_map's check_vma off, the output marked varying (manual_axes.py).
    return mark_varying(out, idx, x)
