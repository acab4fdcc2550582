"""The gmm backend's gate and up projections and the gated activation in one Pallas TPU kernel.

Without it, gate and up are two Megablox ``gmm`` calls that each read the ``[M_pad, H]``
sorted token rows and write a float32 ``[M_pad, I]`` result, and XLA reads both back to form
``silu(gate) * up * routing weight`` in the compute dtype. Here each grid step reads one m
tile of the rows ``[tm, H]`` once, multiplies it by its group's gate and up weight blocks
``[H, tn]`` (accumulating in float32 on the MXU), and stores
``(silu(gate) * up * weight).astype(dtype)``: the rows are read once, and the only
``[M_pad, I]`` array written is the activation down reads.

The grid is ``(n tiles of I, m tiles of some group)`` from Megablox's group metadata (a tile
shared by two groups is visited once per group, consecutively: the output block stays in
VMEM between the visits and each visit stores only its group's rows, as Megablox's store
mask does). Rows past the groups are never stored (they hold whatever the output buffer
held); the caller reads only rows inside the groups.

Weights stored K-minor (``gmm.k_minor``: I not a multiple of 128) are read as ``[G, I, H]``
with the contraction on their minor dimension, as Megablox's ``transpose_rhs``: no relayout
copy of the weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sgl_jax.srt.layers.moe import vmem_rows
from sgl_jax.srt.layers.moe.gmm_combine import megablox_gmm, megablox_module
from sgl_jax.srt.layers.moe.manual_axes import mark_varying

# VMEM of the pipelined blocks: the row tile, both weight blocks and the output block, each
# double-buffered. tn (a lane tile of I) shrinks until they fit.
BLOCKS_BUDGET = 24 * 1024 * 1024


def _vmem(tm: int, hidden: int, tn: int, itemsize: int) -> int:
    return 2 * (tm * hidden + 2 * hidden * tn + tm * tn) * itemsize + 2 * tm * 4


def column_tile(tm: int, hidden: int, inter: int, itemsize: int) -> int | None:
    """The widest lane tile of I whose blocks fit ``BLOCKS_BUDGET`` (None: none does)."""
    return next((t for t in vmem_rows.lane_tiles(inter)
                 if _vmem(tm, hidden, t, itemsize) <= BLOCKS_BUDGET), None)


def _kernel(offsets_ref, groups_ref, m_tiles_ref, x_ref, gate_ref, up_ref, weight_ref,
            out_ref, *, contract_minor: bool):
    step = pl.program_id(1)
    tm = x_ref.shape[0]
    dims = (((1,), (1,)), ((), ())) if contract_minor else (((1,), (0,)), ((), ()))
    x = x_ref[...]
    gate = jax.lax.dot_general(x, gate_ref[...], dims, preferred_element_type=jnp.float32)
    up = jax.lax.dot_general(x, up_ref[...], dims, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(gate) * up * weight_ref[...]).astype(out_ref.dtype)
    group = groups_ref[step]
    row = m_tiles_ref[step] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine = (row >= offsets_ref[group]) & (row < offsets_ref[group + 1])
    out_ref[...] = jnp.where(mine, act, out_ref[...])


@functools.partial(jax.jit, static_argnames=("tm", "contract_minor", "interpret"))
def gate_up_act(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, weight: jax.Array,
                group_sizes: jax.Array, tm: int, contract_minor: bool,
                interpret: bool) -> jax.Array:
    """``[M_pad, I]`` in xs's dtype: ``silu(xs @ w_gate[g]) * (xs @ w_up[g]) * weight`` for
    each row inside the groups (g its group; products in float32, one rounding at the end);
    rows past ``sum(group_sizes)`` unspecified.

    xs [M_pad, H] sorted by group, ``M_pad`` a multiple of ``tm``; w_gate, w_up [G, H, I];
    weight [M_pad] float32; group_sizes [G] from row 0; ``contract_minor``: the weights
    are laid out K-minor (``gmm.k_minor``). The caller checks :func:`column_tile`."""
    m_pad, hidden = xs.shape
    groups, _, inter = w_gate.shape
    group_sizes = group_sizes.astype(jnp.int32)
    weight = weight.astype(jnp.float32).reshape(m_pad, 1)
    if interpret and vmem_rows.under_manual_axes(xs, w_gate, weight):
        return _gate_up_jnp(xs, w_gate, w_up, weight, group_sizes, tm)
    tn = column_tile(tm, hidden, inter, xs.dtype.itemsize)
    if m_pad % tm or tn is None:
        raise ValueError(f"gate_up_act: {m_pad} rows by tm={tm}, H={hidden}, I={inter}: the "
                         f"rows must be a multiple of tm and the blocks fit VMEM")
    (offsets, group_ids, m_tiles), active = megablox_module.make_group_metadata(
        group_sizes=group_sizes, m=m_pad, tm=tm, start_group=jnp.int32(0),
        num_nonzero_groups=groups, visit_empty_groups=False)
    if contract_minor:  # the K-minor layout read as it is stored (a bitcast, no copy)
        w_gate, w_up = w_gate.swapaxes(1, 2), w_up.swapaxes(1, 2)
        w_block = pl.BlockSpec((None, tn, hidden), lambda n, t, o, g, mt: (g[t], n, 0))
    else:
        w_block = pl.BlockSpec((None, hidden, tn), lambda n, t, o, g, mt: (g[t], 0, n))
    rows = pl.BlockSpec((tm, hidden), lambda n, t, o, g, mt: (mt[t], 0))
    max_tiles = m_pad // tm + groups - 1
    item = xs.dtype.itemsize
    cost = pl.CostEstimate(  # static, as Megablox's: two weight blocks per possible m tile
        flops=4 * m_pad * hidden * inter, transcendentals=m_pad * inter,
        bytes_accessed=(m_pad * hidden * item * (inter // tn) + 2 * hidden * inter * item
                        * max_tiles + m_pad * inter * item + m_pad * 4
                        + (2 * max_tiles + groups + 1) * 4))
    with jax_config._check_vma(False):
        out = pl.pallas_call(
            functools.partial(_kernel, contract_minor=contract_minor),
            out_shape=jax.ShapeDtypeStruct((m_pad, inter), xs.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3,
                grid=(inter // tn, active),
                in_specs=[rows, w_block, w_block,
                          pl.BlockSpec((tm, 1), lambda n, t, o, g, mt: (mt[t], 0))],
                out_specs=pl.BlockSpec((tm, tn), lambda n, t, o, g, mt: (mt[t], n))),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"),
                vmem_limit_bytes=vmem_rows.VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(offsets, group_ids, m_tiles, xs, w_gate, w_up, weight)
    return mark_varying(out, xs, w_gate, weight, group_sizes)


def _gate_up_jnp(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, weight: jax.Array,
                 group_sizes: jax.Array, tm: int) -> jax.Array:
    """:func:`gate_up_act`'s arithmetic without the kernel: Megablox's gate and up in
    float32 (interpret mode), the activation in float32, one rounding."""
    _, hidden, inter = w_gate.shape
    with jax_config._check_vma(False):
        gate, up = (megablox_gmm(xs, w, group_sizes, preferred_element_type=jnp.float32,
                                 tiling=(tm, hidden, inter), interpret=True)
                    for w in (w_gate, w_up))
    gate, up = (mark_varying(a, xs, w_gate, group_sizes) for a in (gate, up))
    return (jax.nn.silu(gate) * up * weight).astype(xs.dtype)
