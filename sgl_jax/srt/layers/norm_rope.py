"""Per-head RMSNorm and rotary embedding of q or k in one Pallas TPU kernel.

XLA:TPU compiles the query path of ``GqaAttention`` (``norm.rms_norm`` of each head, then
``rotary.apply_rotary``'s "rotate half") into several fusions: the rotation's two 64-lane
halves of a 128-wide head are half a vreg each, so XLA writes the normed heads in float32,
both rotated halves, and their concatenation (compile-only v6e, Qwen3-30B-A3B at tp 4, an
8,192-token prefill: about 335 MB of HBM traffic per layer for q, against 34 MB of q read
and written once). This kernel reads each ``[tokens, heads * D]`` block once and writes it
once: per head, the norm in float32 (rounded to the activation dtype, as ``rms_norm``), the
rotation by a lane roll of ``D / 2`` (``pltpu.roll``) and two multiply-adds with the
precomputed ``cos`` / ``sin`` of each token (one ``[T, D]`` float32 table, ``[cos | sin]``,
expanded in VMEM), one rounding at the end, as ``apply_rotary``.

It covers the layout it was written for, and the callers fall back to the jnp path
otherwise (:func:`supported`): full "rotate half" rotary (no partial or interleaved
rotation), ``D`` a multiple of 128, each device holding whole heads. Under tensor
parallelism the kernel, a custom call XLA cannot partition, runs inside ``shard_map`` on the
device's heads (and, with DP attention, its rank's tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see layers/moe/gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.configs.rope_scaling import RopeScaling
from sgl_jax.srt.layers.attention.data_parallel import DATA_AXIS, TENSOR_AXIS
from sgl_jax.srt.layers.rotary import rotation_table

LANE = 128
TOKEN_BLOCK = 256  # tokens per grid step (a multiple of 16: bf16 sublane packing)
BLOCK_BYTES = 2 * 1024 * 1024  # the parts' blocks of x; in and out double-buffered: 8 MiB


def supported(head_dim: int, rotary_dim: int, interleaved: bool, heads: int,
              tp: int) -> bool:
    """Whether the kernel handles this layout: full half-split rotary over a lane-aligned
    head, and every device of the tensor axis holding whole heads."""
    return (rotary_dim == head_dim and not interleaved and head_dim % LANE == 0
            and heads % tp == 0)


@dataclass(frozen=True)
class Part:
    """One projection the kernel norms and rotates: ``heads`` heads (of the whole model: each
    device takes ``heads / tp``) in column block ``column_block`` of x (blocks of the
    device's ``heads / tp * D`` columns), its RMSNorm ``weight`` (None: no norm), and
    whether the result is ``[T, heads, D]`` (``heads_axis``) or ``[T, heads * D]``."""

    heads: int
    weight: jax.Array | None = None
    column_block: int = 0
    heads_axis: bool = False


def rotate_heads(x_ref, w_ref, out_ref, cos: jax.Array, sin: jax.Array, heads: int,
                 eps: float | None) -> None:
    """In a kernel: one part's block of tokens, each head normed (if ``w_ref``) and rotated
    (``cos``, ``sin``: :func:`expand_table`), stored once into ``out_ref`` (``[tokens,
    heads, D]`` or ``[tokens, heads * D]``)."""
    head_dim = cos.shape[1]
    for h in range(heads):  # static: whole heads, lane-aligned column blocks
        cols = slice(h * head_dim, (h + 1) * head_dim)
        x = x_ref[:, cols]
        if w_ref is not None:
            x32 = x.astype(jnp.float32)
            scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
            x = (x32 * scale * w_ref[...].astype(jnp.float32)).astype(x_ref.dtype)
        x32 = x.astype(jnp.float32)
        # "Rotate half": dims i and i + D/2 pair up; a roll by D/2 brings each dim's partner
        # to it, and sin carries the sign (-sin on the first half, +sin on the second).
        partner = pltpu.roll(x32, head_dim // 2, 1)
        y = (x32 * cos + partner * sin).astype(out_ref.dtype)
        if len(out_ref.shape) == 3:  # [tokens, heads, D]: head h is sublane h of each token
            out_ref[:, h, :] = y
        else:
            out_ref[:, cols] = y


def _kernel(*refs, parts: tuple[tuple[int, bool], ...], eps: float | None):
    # refs: each part's x block, the table, the normed parts' weights, each part's output.
    n = len(parts)
    x_refs, table_ref = refs[:n], refs[n]
    normed = [has_norm for _, has_norm in parts]
    w_iter = iter(refs[n + 1:n + 1 + sum(normed)])
    w_refs = [next(w_iter) if has_norm else None for has_norm in normed]
    out_refs = refs[n + 1 + sum(normed):]
    cos, sin = expand_table(table_ref[...])  # once for all the parts
    for (heads, _), x_ref, w_ref, out_ref in zip(parts, x_refs, w_refs, out_refs, strict=True):
        rotate_heads(x_ref, w_ref, out_ref, cos, sin, heads, eps)


def expand_table(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """In a kernel: a block of ``rotary.rotation_table`` rows, ``[cos | sin]``, as the
    ``[cos | cos]`` and ``[-sin | sin]`` that :func:`rotate_heads` multiplies by (exactly
    the table's values)."""
    head_dim = table.shape[1]
    swapped = pltpu.roll(table, head_dim // 2, 1)  # [sin | cos]
    first = jax.lax.broadcasted_iota(jnp.int32, table.shape, 1) < head_dim // 2
    return jnp.where(first, table, swapped), jnp.where(first, -swapped, table)


@functools.partial(jax.jit, static_argnames=("layout", "eps", "interpret"))
def _norm_rope_local(x: jax.Array, table: jax.Array, *weights: jax.Array,
                     layout: tuple[tuple[int, int, bool, bool], ...], eps: float | None,
                     interpret: bool) -> tuple[jax.Array, ...]:
    """One device's parts of x (``layout``: per part its local heads, column block, heads
    axis and whether it is normed, ``weights`` those parts' norm weights), the kernel's grid
    over token blocks."""
    tokens = x.shape[0]
    head_dim = table.shape[1]
    width = sum(heads for heads, *_ in layout) * head_dim  # every part's block is in VMEM
    # At most TOKEN_BLOCK tokens, and a block of x within BLOCK_BYTES (wide rows at tp 1).
    fit = max(16, BLOCK_BYTES // (width * x.dtype.itemsize) // 16 * 16)
    block = min(TOKEN_BLOCK, fit, -(-tokens // 16) * 16)
    pad = -tokens % block
    if pad:
        x, table = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, table))

    def rows(cols: int, column: int = 0) -> pl.BlockSpec:
        return pl.BlockSpec((block, cols), lambda i: (i, column))

    in_specs = [rows(heads * head_dim, column) for heads, column, *_ in layout]
    in_specs += [rows(head_dim)]
    in_specs += [pl.BlockSpec((1, head_dim), lambda i: (0, 0)) for *_, normed in layout
                 if normed]
    out_shapes, out_specs = [], []
    for heads, _, heads_axis, _ in layout:
        if heads_axis:
            out_shapes.append(jax.ShapeDtypeStruct((x.shape[0], heads, head_dim), x.dtype))
            out_specs.append(pl.BlockSpec((block, heads, head_dim), lambda i: (i, 0, 0)))
        else:
            out_shapes.append(jax.ShapeDtypeStruct((x.shape[0], heads * head_dim), x.dtype))
            out_specs.append(rows(heads * head_dim))
    item = x.dtype.itemsize
    size = x.shape[0] * head_dim * sum(heads for heads, *_ in layout)  # read, and written
    cost = pl.CostEstimate(
        flops=8 * size,
        transcendentals=x.shape[0] * sum(h for h, *_, normed in layout if normed),
        bytes_accessed=2 * size * item + table.size * 4 + len(weights) * head_dim * item)
    with jax_config._check_vma(False):
        outs = pl.pallas_call(
            functools.partial(_kernel, parts=tuple((h, n) for h, _, _, n in layout), eps=eps),
            out_shape=tuple(out_shapes),
            grid=(x.shape[0] // block,),
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            cost_estimate=cost,
            interpret=interpret,
        )(*([x] * len(layout)), table, *(w.reshape(1, head_dim) for w in weights))
    return tuple(o[:tokens] for o in outs) if pad else tuple(outs)


def norm_rope_parts(x: jax.Array, parts: Sequence[Part], positions: jax.Array, theta: float,
                    head_dim: int, eps: float | None, interpret: bool,
                    tokens_split: bool = False,
                    yarn: RopeScaling | None = None) -> tuple[jax.Array, ...]:
    """Several projections side by side in x (``GqaAttention``'s fused q/k/v: on each device
    its q, k and v columns next to each other, the blocks split over "tensor"), each
    :class:`Part` normed and rotated by one kernel: the rotation table read once, each
    part's columns read in place (never sliced out of x), the others never read. The
    arithmetic of ``rms_norm`` then ``apply_rotary`` (:func:`norm_rope`); ``eps`` None: no
    norm. The caller checks :func:`supported` for every part."""
    table = rotation_table(positions, theta, head_dim, yarn)
    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty else mesh.shape.get(TENSOR_AXIS, 1)
    weights = tuple(p.weight for p in parts if eps is not None and p.weight is not None)
    layout = tuple((p.heads // tp, p.column_block, p.heads_axis,
                    eps is not None and p.weight is not None) for p in parts)
    local = functools.partial(_norm_rope_local, layout=layout, eps=eps, interpret=interpret)
    if mesh.empty or TENSOR_AXIS in mesh.manual_axes:  # in a caller's shard_map: x is local
        return local(x, table, *weights)
    # A custom call XLA cannot partition: always under shard_map on a mesh (tp 1 with DP
    # attention too, where the tokens are split over the ranks).
    tokens = DATA_AXIS if tokens_split else None
    run = jax.shard_map(
        local, mesh=mesh,
        in_specs=(P(tokens, TENSOR_AXIS), P(tokens), *(P() for _ in weights)),
        out_specs=tuple(P(tokens, TENSOR_AXIS, None) if p.heads_axis else P(tokens, TENSOR_AXIS)
                        for p in parts),
        check_vma=False)
    return run(x, table, *weights)


def norm_rope(x: jax.Array, weight: jax.Array | None, positions: jax.Array, theta: float,
              heads: int, eps: float | None, interpret: bool, tokens_split: bool = False,
              yarn: RopeScaling | None = None, head_dim: int | None = None,
              column_block: int = 0, heads_axis: bool = False) -> jax.Array:
    """``[T, heads * D]`` (the projection's output) -> the same, each head RMS-normed with
    ``weight`` (``eps`` None: no norm) and rotated by ``positions`` [T]; the arithmetic of
    ``rms_norm`` then ``apply_rotary``. ``tokens_split`` (DP attention): the tokens are split
    over the ranks, as the heads over "tensor". The caller checks :func:`supported`.

    With ``head_dim`` given, x may be wider: several projections side by side on each
    device (``GqaAttention``'s fused q/k/v, split over "tensor" in equal blocks of columns),
    of which the kernel reads only block ``column_block`` of the device's ``heads / tp``
    heads: the others are never read, and no slice of x is copied out for it.

    ``heads_axis``: the result as ``[T, heads, D]``, written in that layout by the kernel
    (XLA:TPU tiles a ``[T, heads, D]`` array by (heads, D): the attention kernel's q layout;
    a ``[T, heads * D]`` result reshaped to it is a relayout copy of q)."""
    head_dim = x.shape[1] // heads if head_dim is None else head_dim
    part = Part(heads, weight, column_block, heads_axis)
    return norm_rope_parts(x, (part,), positions, theta, head_dim, eps, interpret,
                           tokens_split, yarn)[0]
