"""Column-parallel projections ``x @ w`` of one input at prefill (q, k and v) as a Pallas TPU
kernel holding the device's weight blocks in VMEM and streaming the tokens through them once.

XLA:TPU tiles a large ``[T, K] @ [K, N]`` dot so that it reads x several times (compile-only
v5p, bf16, one dot alone: the 235B's q projection of a DP rank's 2,048 tokens, ``[2,048,
4,096] @ [4,096, 2,048]``, is counted at 109 MB against 42 MB of operands and result; its k
projection, ``N`` = 128, at 86 MB against 18), and three dots of one x read it three times.
Here each ``[K, N_i]`` weight block of the device is one VMEM block, fetched once
(single-buffered: its index never changes), and each grid step multiplies one ``[tm, K]``
token tile by every block: x read once, the weights once, the results written once, which
is the kernel's cost estimate.

With q and k (``GqaAttention._projections``) the kernel also norms and rotates them after
their products, per token tile, as ``layers/norm_rope.py`` does (the same arithmetic on the
product rounded to the activation dtype, held in a VMEM copy): q and k are never written
unrotated and read back (compile-only v5p, the 235B's DP prefill: 139.8 -> 131.7 GB per
device).

Used where it pays and fits (:func:`row_tile`): a step of at least ``MIN_TOKENS`` tokens
in a device's share (a prefill; a decode batch that large too), the weight blocks and the
streamed tiles within ``vmem_rows.KERNEL_BUDGET``. Smaller steps keep XLA's dot (there the
weights dominate and are read once either way). Under tensor parallelism the kernel, a custom call
XLA cannot partition, runs inside ``shard_map`` on the device's columns (and, with DP
attention, its rank's tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see layers/moe/gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers import norm_rope
from sgl_jax.srt.layers.attention.data_parallel import DATA_AXIS, TENSOR_AXIS
from sgl_jax.srt.layers.moe import vmem_rows

MIN_TOKENS = 512  # a device's tokens below which XLA's dot is kept (decode, short extends)
ROW_TILES = (512, 256, 128)  # token tiles tried, largest first


def row_tile(tokens: int, k: int, n: int, itemsize: int, rotated: int = 0,
             head_dim: int = 0, out_cols: int | None = None) -> int | None:
    """The token tile of ``tokens`` rows (a device's share) times ``[k, n]`` of weights (the
    blocks of one call side by side, ``rotated`` of the ``n`` columns normed and rotated
    after the product; ``out_cols``: the output blocks' columns as laid out in VMEM, ``n``
    unless padded), or None where XLA's dot stays: fewer than ``MIN_TOKENS`` tokens, no
    tile dividing them, or VMEM over ``vmem_rows.KERNEL_BUDGET``: the weight blocks
    (single-buffered), the double-buffered token, output and rotation-table tiles, the
    float32 products, the rotated columns' rounded copy and the expanded cos / sin."""
    if tokens < MIN_TOKENS:
        return None
    out_cols = n if out_cols is None else out_cols
    for tm in ROW_TILES:
        vmem = (k * n * itemsize + 2 * tm * (k + out_cols) * itemsize + tm * n * 4
                + tm * (rotated * itemsize + (4 * head_dim * 4 if rotated else 0)))
        if tokens % tm == 0 and vmem <= vmem_rows.KERNEL_BUDGET:
            return tm
    return None


# Per output of a call: None (the product as it is), or (the device's heads, normed, heads
# axis): the product rounded to x's dtype, then each head RMS-normed (if normed) and rotated,
# norm_rope's arithmetic; written [T, heads, D] with the heads axis, else [T, heads * D].
Rotation = tuple[int, bool, bool] | None


def _kernel(*refs, rotations: tuple[Rotation, ...], eps: float | None):
    """One token tile times each weight block. ``refs``: x, the weights, (with rotations) the
    rotation table and the normed outputs' norm weights, the outputs, then the rotated
    outputs' VMEM copies of their rounded products."""
    n = len(rotations)
    rotated = [r for r in rotations if r is not None]
    x_ref, w_refs = refs[0], refs[1:1 + n]
    rest = refs[1 + n:]
    table_ref, rest = (rest[0], rest[1:]) if rotated else (None, rest)
    normed = sum(r[1] for r in rotated)
    norm_refs, out_refs, scratch_refs = rest[:normed], rest[normed:normed + n], rest[normed + n:]
    norm_iter, scratch_iter = iter(norm_refs), iter(scratch_refs)
    cos, sin = norm_rope.expand_table(table_ref[...]) if rotated else (None, None)
    x = x_ref[...]
    for rotation, w_ref, out_ref in zip(rotations, w_refs, out_refs, strict=True):
        y = jnp.dot(x, w_ref[...], preferred_element_type=jnp.float32)
        if rotation is None:
            out_ref[...] = y.astype(out_ref.dtype)
            continue
        heads, has_norm, _ = rotation
        rounded = next(scratch_iter)
        rounded[...] = y.astype(rounded.dtype)  # as the projection is rounded unfused
        norm_rope.rotate_heads(rounded, next(norm_iter) if has_norm else None, out_ref,
                               cos, sin, heads, eps)


@functools.partial(jax.jit, static_argnames=("tm", "interpret", "rotations", "eps"))
def token_matmul(x: jax.Array, ws: tuple[jax.Array, ...], tm: int, interpret: bool = False,
                 rotations: tuple[Rotation, ...] | None = None, table: jax.Array | None = None,
                 norms: tuple[jax.Array, ...] = (), eps: float | None = None
                 ) -> tuple[jax.Array, ...]:
    """``x @ w`` for each w of ``ws`` in x's dtype (accumulated in float32), x read once:
    x ``[T, K]``, each w ``[K, N_i]``, ``T`` a multiple of ``tm`` (:func:`row_tile`). With
    ``rotations`` (one per w, see :data:`Rotation`), ``table`` is ``rotary.rotation_table``
    of the tokens' positions ``[T, D]`` and ``norms`` the normed outputs' RMSNorm weights
    ``[D]`` in order, ``eps`` theirs."""
    tokens, k = x.shape
    widths = [w.shape[1] for w in ws]
    rotations = rotations or (None,) * len(ws)
    item = x.dtype.itemsize
    head_dim = 0 if table is None else table.shape[1]
    rotated = [(n, r) for n, r in zip(widths, rotations, strict=True) if r is not None]
    cost = pl.CostEstimate(
        flops=2 * tokens * k * sum(widths) + 8 * tokens * sum(n for n, _ in rotated),
        transcendentals=tokens * sum(r[0] for _, r in rotated if r[1]),
        bytes_accessed=(tokens * k + (k + tokens) * sum(widths)) * item
        + (tokens * head_dim * 4 if rotated else 0) + len(norms) * head_dim * item)

    def rows(*block: int) -> pl.BlockSpec:
        return pl.BlockSpec((tm, *block), lambda i: (i,) + (0,) * len(block))

    in_specs = [rows(k)] + [pl.BlockSpec((k, n), lambda i: (0, 0), pipeline_mode=pl.Buffered(1))
                            for n in widths]
    operands = [x, *ws]
    if rotated:
        in_specs += [rows(head_dim)] + [pl.BlockSpec((1, head_dim), lambda i: (0, 0))] * len(norms)
        operands += [table] + [w.reshape(1, head_dim) for w in norms]
    out_shapes, out_specs = [], []
    for n, rotation in zip(widths, rotations, strict=True):
        shape = (n // head_dim, head_dim) if rotation is not None and rotation[2] else (n,)
        out_shapes.append(jax.ShapeDtypeStruct((tokens, *shape), x.dtype))
        out_specs.append(rows(*shape))
    with jax_config._check_vma(False):
        return pl.pallas_call(
            functools.partial(_kernel, rotations=rotations, eps=eps),
            out_shape=tuple(out_shapes),
            grid=(tokens // tm,),
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            scratch_shapes=[pltpu.VMEM((tm, n), x.dtype) for n, _ in rotated],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                                 vmem_limit_bytes=vmem_rows.VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(*operands)


def column_parallel(x: jax.Array, ws: tuple[jax.Array, ...], interpret: bool,
                    tokens_split: bool = False,
                    parts: tuple[norm_rope.Part | None, ...] | None = None,
                    table: jax.Array | None = None, eps: float | None = None,
                    ) -> tuple[jax.Array, ...] | None:
    """``x @ w`` for each w of ``ws``, in one kernel call reading x once: x ``[T, K]`` (whole
    on every device, or with ``tokens_split`` split by token over the DP attention ranks),
    each w ``[K, N_i]`` split by column over "tensor", the kernel on each device's columns,
    each result laid out ``[T, N_i]`` as XLA's dot would be; None where the kernel does not
    apply (:func:`row_tile` on the weights together, no "tensor" axis in the mesh in
    context), for the caller's dots.

    ``parts`` (one per w, None for a plain product): each such output's heads normed and
    rotated after the product, ``layers/norm_rope.py``'s arithmetic on the rounded product
    (the caller checks ``norm_rope.supported``): ``table`` the rotation table of the tokens
    ``[T, D]``, ``eps`` the norms' (a part's ``heads_axis``: ``[T, heads, D]``; its
    ``column_block`` is not used: each output is its own w's)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR_AXIS not in mesh.axis_names or TENSOR_AXIS in mesh.manual_axes:
        return None
    tp = mesh.shape[TENSOR_AXIS]
    ranks = mesh.shape[DATA_AXIS] if tokens_split else 1
    tokens, k = x.shape
    widths = [w.shape[1] for w in ws]
    parts = parts or (None,) * len(ws)
    if tokens % ranks or any(n % tp for n in widths):
        return None
    head_dim = 0 if table is None else table.shape[1]
    sublanes = 32 // x.dtype.itemsize  # rows of a VMEM tile: 8 float32, 16 bfloat16
    out_cols = 0
    for n, part in zip(widths, parts, strict=True):
        if part is None:
            out_cols += n // tp
            continue
        if part.heads * head_dim != n or part.heads % tp:
            raise ValueError(f"token_matmul: a rotated output of {n} columns must be its "
                             f"heads ({part.heads}) x the table's {head_dim}, whole heads on "
                             f"each of the {tp} tensor devices")
        if part.weight is not None and eps is None:
            raise ValueError("token_matmul: a normed output needs the norm's eps")
        heads = part.heads // tp  # [tm, heads, D] blocks: the heads padded to whole tiles
        out_cols += (-(-heads // sublanes) * sublanes if part.heads_axis else heads) * head_dim
    rotated = sum(n for n, part in zip(widths, parts, strict=True) if part is not None) // tp
    tm = row_tile(tokens // ranks, k, sum(widths) // tp, x.dtype.itemsize, rotated, head_dim,
                  out_cols)
    if tm is None:
        return None
    rotations = tuple(None if p is None else (p.heads // tp, p.weight is not None, p.heads_axis)
                      for p in parts)
    norms = tuple(p.weight for p in parts if p is not None and p.weight is not None)
    rows = DATA_AXIS if tokens_split else None
    extra, extra_specs = (), ()
    if rotated:
        extra, extra_specs = (table, *norms), (P(rows, None),) + (P(),) * len(norms)

    def local(x, *args):
        ws, extra = args[:len(widths)], args[len(widths):]
        table, norms = (extra[0], extra[1:]) if extra else (None, ())
        return token_matmul(x, ws, tm=tm, interpret=interpret,
                            rotations=rotations if rotated else None, table=table,
                            norms=norms, eps=eps)

    out_specs = tuple(P(rows, TENSOR_AXIS, None) if p is not None and p.heads_axis
                      else P(rows, TENSOR_AXIS) for p in parts)
    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(P(rows, None),) + (P(None, TENSOR_AXIS),) * len(ws)
                        + extra_specs,
                        out_specs=out_specs, check_vma=False)
    return run(x, *(w.astype(x.dtype) for w in ws), *extra)
