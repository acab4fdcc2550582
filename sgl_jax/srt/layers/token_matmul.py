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

from sgl_jax.srt.layers.attention.data_parallel import DATA_AXIS, TENSOR_AXIS
from sgl_jax.srt.layers.moe import vmem_rows

MIN_TOKENS = 512  # a device's tokens below which XLA's dot is kept (decode, short extends)
ROW_TILES = (512, 256, 128)  # token tiles tried, largest first


def row_tile(tokens: int, k: int, n: int, itemsize: int) -> int | None:
    """The token tile of ``tokens`` rows (a device's share) times ``[k, n]`` of weights (the
    blocks of one call side by side), or None where XLA's dot stays: fewer than
    ``MIN_TOKENS`` tokens, no tile dividing them, or the weight blocks (single-buffered), the
    double-buffered token and result tiles and the float32 dot values over
    ``vmem_rows.KERNEL_BUDGET``."""
    if tokens < MIN_TOKENS:
        return None
    for tm in ROW_TILES:
        vmem = k * n * itemsize + 2 * tm * (k + n) * itemsize + tm * n * 4
        if tokens % tm == 0 and vmem <= vmem_rows.KERNEL_BUDGET:
            return tm
    return None


def _kernel(x_ref, *refs):
    """One token tile times each weight block: ``refs`` is the weights, then the outputs."""
    x = x_ref[...]
    half = len(refs) // 2
    for w_ref, out_ref in zip(refs[:half], refs[half:], strict=True):
        out_ref[...] = jnp.dot(x, w_ref[...],
                               preferred_element_type=jnp.float32).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tm", "interpret"))
def token_matmul(x: jax.Array, ws: tuple[jax.Array, ...], tm: int,
                 interpret: bool = False) -> tuple[jax.Array, ...]:
    """``x @ w`` for each w of ``ws`` in x's dtype (accumulated in float32), x read once:
    x ``[T, K]``, each w ``[K, N_i]``, ``T`` a multiple of ``tm`` (:func:`row_tile`)."""
    tokens, k = x.shape
    widths = [w.shape[1] for w in ws]
    item = x.dtype.itemsize
    cost = pl.CostEstimate(flops=2 * tokens * k * sum(widths), transcendentals=0,
                           bytes_accessed=(tokens * k + (k + tokens) * sum(widths)) * item)
    with jax_config._check_vma(False):
        return pl.pallas_call(
            _kernel,
            out_shape=tuple(jax.ShapeDtypeStruct((tokens, n), x.dtype) for n in widths),
            grid=(tokens // tm,),
            in_specs=[pl.BlockSpec((tm, k), lambda i: (i, 0))]
            + [pl.BlockSpec((k, n), lambda i: (0, 0), pipeline_mode=pl.Buffered(1))
               for n in widths],
            out_specs=tuple(pl.BlockSpec((tm, n), lambda i: (i, 0)) for n in widths),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                                 vmem_limit_bytes=vmem_rows.VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(x, *ws)


def column_parallel(x: jax.Array, ws: tuple[jax.Array, ...], interpret: bool,
                    tokens_split: bool = False) -> tuple[jax.Array, ...] | None:
    """``x @ w`` for each w of ``ws``, in one kernel call reading x once: x ``[T, K]`` (whole
    on every device, or with ``tokens_split`` split by token over the DP attention ranks),
    each w ``[K, N_i]`` split by column over "tensor", the kernel on each device's columns,
    each result laid out ``[T, N_i]`` as XLA's dot would be; None where the kernel does not
    apply (:func:`row_tile` on the weights together, no "tensor" axis in the mesh in
    context), for the caller's dots."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR_AXIS not in mesh.axis_names or TENSOR_AXIS in mesh.manual_axes:
        return None
    tp = mesh.shape[TENSOR_AXIS]
    ranks = mesh.shape[DATA_AXIS] if tokens_split else 1
    tokens, k = x.shape
    widths = [w.shape[1] for w in ws]
    if tokens % ranks or any(n % tp for n in widths):
        return None
    tm = row_tile(tokens // ranks, k, sum(widths) // tp, x.dtype.itemsize)
    if tm is None:
        return None
    rows = DATA_AXIS if tokens_split else None
    run = jax.shard_map(
        lambda x, *ws: token_matmul(x, ws, tm=tm, interpret=interpret),
        mesh=mesh, in_specs=(P(rows, None),) + (P(None, TENSOR_AXIS),) * len(ws),
        out_specs=(P(rows, TENSOR_AXIS),) * len(ws), check_vma=False)
    return run(x, *(w.astype(x.dtype) for w in ws))
