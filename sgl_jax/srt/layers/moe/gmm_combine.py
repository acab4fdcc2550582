"""The gmm backend's down projection and per-token combine in one Pallas TPU kernel.

Otherwise down writes an ``[M_pad, H]`` array of the sorted assignments' rows (Megablox
``gmm``) and the un-permute reads it back to add each row into its token's sum: at an
8,192-token prefill of the 30B at tp 4, 65,536 rows of 2,048 columns written and read once
more per layer. Here each grid step multiplies one m tile of the activations ``[tm, I]`` by
its group's ``[I, tn]`` weight block and adds the tile's rows of that group straight into
the float32 sums of their tokens, held in VMEM a column block at a time (``[T, tn]``,
:func:`column_width`): the ``[M_pad, H]`` rows never reach HBM, and they are added in float32
as the MXU produced them (no rounding to the compute dtype in between).

The grid is ``(n tiles, m tiles of some group)``, the m tiles from Megablox's own group
metadata (``make_group_metadata``: a tile shared by two groups is visited once per group,
consecutively; tiles holding only rows past the groups are not visited), so the weights and
activations move as in Megablox's ``gmm`` with ``tk = K``. A step adds only the rows of its
group (``[group start, group end)`` clipped to the tile): rows past the groups (sentinel,
padding) are computed by the MXU with the rest of their tile but never read.
Rows are added in sorted order (group by group, row by row), each multiplied by its routing
weight as it is added when the caller passes the weights (float32 scalars prefetched to SMEM
next to the row tokens: no ``[M_pad, 1]`` column, which HBM lays out 128 lanes wide, for
gate/up to read). With an output dtype narrower than float32 the float32 sums are a VMEM
scratch (starting from ``init``, in the output dtype, if given) and the output stays in
HBM: after a column block's last step the kernel rounds its sums once, ``STAGE_ROWS`` rows
at a time into two staging buffers in turn, and copies them out by DMA (one block rounded
while the one before is copied). The ``[T, H]`` float32 sums
are not written to HBM and read back to cast, and VMEM holds 4 bytes per element of the
column block, not 6 with a bfloat16 output block next to the sums: wider blocks, fewer
reads of the activations.

Cost. The pipeline skips a block's copy when its index is unchanged from the previous grid
step, and a group's m tiles are consecutive steps (a tile shared by two groups: two
consecutive steps on the same activation block). So for each n tile every group's weight
block is fetched once, however many m tiles it spans, and every m tile's activations once:
the kernel's estimate is the activations once per n tile, the weights once, the sums once
and the indices, for any routing (``init`` not counted: it is read by a second pass only,
which a device takes when it gets more than ``gmm.CAPACITY_FACTOR`` times its share of the
assignments). (Megablox's own estimate counts one weight block per possible m tile,
``M_pad / tm + G - 1``: its k tiles change the weight block's index at every step when
``tk < K``; here ``tk = K`` always.) FLOPs are
``2 * M_pad * I * H``, Megablox's convention: the MXU also multiplies the other rows of a
partly owned tile, up to ``(M_pad / tm + G - 1) / (M_pad / tm)`` times that at decode.

``init`` (the sums of earlier passes, ``gmm.gmm_experts`` under EP) is the held block's
starting value: the pass's rows are added to it in the same kernel, not by a separate add.
The kernel copies each of its column blocks in itself (at the column block's first step: one
DMA into a float32 output block, or staged into the float32 scratch) and only when told to
(``reads_init``): a first pass's
loop-carried buffer is allocated, never initialised nor read (``gmm.gmm_experts``).
Off TPU inside ``shard_map`` (where Pallas interpret mode cannot run a kernel with a held
block: ``vmem_rows.under_manual_axes``) the same arithmetic runs in jnp: Megablox's down in
float32 and a scatter-add in row order.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see gmm.grouped_matmul
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

from sgl_jax.srt.layers.moe import vmem_rows
from sgl_jax.srt.layers.moe.manual_axes import mark_varying

# The module (the package exports its ``gmm`` function under the same name): its group
# metadata is the tile schedule the fused kernels share with Megablox's.
megablox_module = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def tile_schedule(group_sizes: jax.Array, m_pad: int,
                  tm: int) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array, int]:
    """Megablox's tile schedule of ``M_pad`` sorted rows in ``tm``-row tiles: ((group
    offsets [G + 1], group of each step, m tile of each step), the number of steps (data),
    the most steps any routing can take, ``M_pad / tm + G - 1``). Empty groups get no
    step; a tile shared by groups gets one step per group, consecutively."""
    groups = group_sizes.shape[0]
    metadata, active = megablox_module.make_group_metadata(
        group_sizes=group_sizes, m=m_pad, tm=tm, start_group=jnp.int32(0),
        num_nonzero_groups=groups, visit_empty_groups=False)
    return metadata, active, m_pad // tm + groups - 1


# VMEM per element of the held sums' column block: float32. A float32 output is that block
# itself (a single buffer, ``pl.Buffered(1)``: its index changes once per column block, and
# a double buffer would halve the width held, doubling the activations' reads); a narrower
# one stays in HBM, and the float32 sums (a scratch) pass through two STAGE_ROWS-row
# buffers in the output dtype, on their way in (a later pass's ``init``) and out.
SUMS_BYTES = 4
STAGE_ROWS = 256


def stage_rows(t_pad: int) -> int:
    """Rows of a staging buffer: the largest divisor of ``STAGE_ROWS`` that divides the
    padded tokens ``t_pad`` (a multiple of ``vmem_rows.BLOCK``, so at least 16 rows; all
    256 when ``t_pad`` is a multiple of 256, as a prefill's padded token count is)."""
    return math.gcd(t_pad, STAGE_ROWS)


def _vmem(t_pad: int, cols: int, tm: int, inter: int, itemsize: int,
          out_itemsize: int = 4) -> int:
    """VMEM of one column width: the held float32 sums, the staging buffer of a narrower
    output, double-buffered activation and weight blocks, the float32 tile scratch and the
    dot's float32 value."""
    stage = 0 if out_itemsize == 4 else 2 * stage_rows(t_pad) * cols * out_itemsize
    return (t_pad * cols * SUMS_BYTES + stage
            + 2 * (tm * inter + inter * cols) * itemsize + 2 * tm * cols * 4)


def column_width(tokens: int, hidden: int, tm: int, inter: int, itemsize: int,
                 out_itemsize: int = 4, vmem_limit: int = vmem_rows.VMEM_LIMIT) -> int | None:
    """The widest column block of the ``[tokens, hidden]`` sums (a lane tile of H) whose
    held sums and whole footprint fit the budgets of a scoped VMEM limit of ``vmem_limit``
    (``vmem_rows.budgets``); None: not even 128 columns do."""
    t_pad = vmem_rows.pad_block(tokens)
    held, whole = vmem_rows.budgets(vmem_limit)
    return next((c for c in vmem_rows.lane_tiles(hidden)
                 if t_pad * c * SUMS_BYTES <= held
                 and _vmem(t_pad, c, tm, inter, itemsize, out_itemsize) <= whole),
                None)


def fits(tokens: int, hidden: int, rows: int, tm: int, inter: int, itemsize: int,
         out_itemsize: int = 4, vmem_limit: int = vmem_rows.VMEM_LIMIT) -> bool:
    """Whether :func:`down_and_combine` can run: H a multiple of 128, a column width
    (:func:`column_width`), and the ``rows`` row tokens prefetched to SMEM
    (``vmem_rows.MAX_INDICES``)."""
    return (hidden % vmem_rows.LANE == 0 and rows <= vmem_rows.MAX_INDICES
            and column_width(tokens, hidden, tm, inter, itemsize, out_itemsize,
                             vmem_limit) is not None)


def weighs_rows(rows: int) -> bool:
    """Whether :func:`down_and_combine` can take the ``rows`` routing weights too: float32
    scalars prefetched to SMEM next to the token indices, both within the SMEM of
    ``vmem_rows.MAX_INDICES`` indices."""
    return 2 * rows <= vmem_rows.MAX_INDICES


def _kernel(offsets_ref, groups_ref, m_tiles_ref, token_ref, *refs, with_init: bool,
            weighted: bool, cast: bool):
    refs = list(refs)
    weight_ref = refs.pop(0) if weighted else None  # SMEM, as the tokens
    reads_init_ref = refs.pop(0) if with_init else None  # SMEM [1]: 0 on a first pass
    lhs_ref, w_ref = refs.pop(0), refs.pop(0)
    init_hbm = refs.pop(0) if with_init else None  # HBM: its column block copied on demand
    out_ref, tile_ref = refs.pop(0), refs.pop(0)  # out: HBM when cast, else the held block
    # The float32 sums: the output block itself, or (cast) a scratch staged through a
    # buffer in the output dtype.
    sums_ref, stage_ref = (refs.pop(0), refs.pop(0)) if cast else (out_ref, None)
    dma = refs.pop(0) if with_init or cast else None
    column_block, step = pl.program_id(0), pl.program_id(1)  # (read outside the conds)
    cols = sums_ref.shape[1]
    columns = pl.ds(pl.multiple_of(column_block * cols, cols), cols)

    def stage_block(i) -> pl.Slice:
        """The rows of staging block ``i``."""
        stage = stage_ref.shape[1]
        return pl.ds(pl.multiple_of(i * stage, stage), stage)

    starts_from_zero = step == 0
    if with_init:
        reads_init = reads_init_ref[0] != 0
        starts_from_zero &= jnp.logical_not(reads_init)

        def load(i, carry):  # a later pass only: one staging buffer, one copy at a time
            rows = stage_block(i)
            copy = pltpu.make_async_copy(init_hbm.at[rows, columns], stage_ref.at[0],
                                         dma.at[0])
            copy.start()
            copy.wait()
            sums_ref[rows, :] = stage_ref[0].astype(jnp.float32)
            return carry

        @pl.when((step == 0) & reads_init)
        def _():
            if cast:
                jax.lax.fori_loop(0, sums_ref.shape[0] // stage_ref.shape[1], load, 0)
            else:  # straight into the held output block
                copy = pltpu.make_async_copy(init_hbm.at[:, columns], out_ref, dma.at[0])
                copy.start()
                copy.wait()

    @pl.when(starts_from_zero)
    def _():
        sums_ref[...] = jnp.zeros_like(sums_ref)

    tm = lhs_ref.shape[0]
    tile_ref[...] = jnp.dot(lhs_ref[...], w_ref[...], preferred_element_type=jnp.float32)
    group = groups_ref[step]
    first = m_tiles_ref[step] * tm
    lo = jnp.maximum(offsets_ref[group] - first, 0)
    hi = jnp.minimum(offsets_ref[group + 1] - first, tm)

    def add(r, carry):
        target = token_ref[first + r]
        row = tile_ref[pl.ds(r, 1), :]
        if weighted:
            row = row * weight_ref[first + r]
        sums_ref[pl.ds(target, 1), :] = sums_ref[pl.ds(target, 1), :] + row
        return carry

    jax.lax.fori_loop(lo, hi, add, 0)

    if cast:  # the column block's sums are complete after its last step: rounded once
        @pl.when(step == pl.num_programs(1) - 1)
        def _():
            # Two staging buffers: block i is rounded into one while block i - 1 is copied
            # out of the other.
            blocks = sums_ref.shape[0] // stage_ref.shape[1]

            def out_copy(i):
                return pltpu.make_async_copy(stage_ref.at[i % 2],
                                             out_ref.at[stage_block(i), columns],
                                             dma.at[i % 2])

            def store(i, carry):
                @pl.when(i >= 2)
                def _():
                    out_copy(i - 2).wait()  # its buffer is free again

                stage_ref[i % 2] = sums_ref[stage_block(i), :].astype(stage_ref.dtype)
                out_copy(i).start()
                return carry

            jax.lax.fori_loop(0, blocks, store, 0)
            for i in range(max(blocks - 2, 0), blocks):  # the copies still in flight
                out_copy(i).wait()


@functools.partial(jax.jit,
                   static_argnames=("tokens", "tm", "interpret", "out_dtype", "vmem_limit"))
def down_and_combine(act: jax.Array, w_down: jax.Array, group_sizes: jax.Array,
                     token: jax.Array, init: jax.Array | None, tokens: int, tm: int,
                     interpret: bool, weight: jax.Array | None = None,
                     out_dtype: jnp.dtype = jnp.float32,
                     vmem_limit: int = vmem_rows.VMEM_LIMIT,
                     reads_init: jax.Array | bool = True) -> jax.Array:
    """``[tokens, H]`` in ``out_dtype``: ``init`` (or zeros) plus, for every sorted row ``m``
    inside the groups (``m < sum(group_sizes)``), ``act[m] @ w_down[group of m]`` (times
    ``weight[m]``, if given) added at its token ``token[m]``, in float32, rounded once to
    ``out_dtype`` at the end.

    act [M_pad, I] sorted by group, ``M_pad`` a multiple of ``tm``; w_down [G, I, H] (H a
    multiple of 128); group_sizes [G] from row 0; token [M_pad] in ``[0, tokens)`` wherever
    it is read; weight [M_pad] float32 (the routing weights, prefetched to SMEM with the
    tokens: :func:`weighs_rows`); ``init`` in ``out_dtype`` (the sums of earlier passes,
    each rounded once to it), taken as zeros and never read where ``reads_init`` (a traced
    bool) is false: a first pass's loop-carried buffer (``gmm.gmm_experts``) is allocated,
    not initialised; ``vmem_limit``: the scoped VMEM to ask for
    (``vmem_rows.vmem_limit`` of the chip), which sizes the column blocks. The caller
    checks :func:`fits`."""
    m_pad, inter = act.shape
    groups, _, hidden = w_down.shape
    if m_pad % tm or hidden % vmem_rows.LANE:
        raise ValueError(f"down_and_combine: {m_pad} rows by tm={tm}, H={hidden}: the rows "
                         f"must be a multiple of tm and H of {vmem_rows.LANE}")
    out_dtype = jnp.dtype(out_dtype)
    cast = out_dtype != jnp.float32
    if init is not None and init.dtype != out_dtype:
        raise ValueError(f"down_and_combine: init is {init.dtype}, the output {out_dtype}: "
                         "the sums start from and end in the same dtype")
    group_sizes = group_sizes.astype(jnp.int32)
    token = token.astype(jnp.int32)
    weight = None if weight is None else weight.astype(jnp.float32)
    if interpret and vmem_rows.under_manual_axes(act, token, w_down):
        # The kernel's arithmetic in jnp (module docstring).
        if init is not None:
            init = jnp.where(reads_init, init, jnp.zeros((), init.dtype))
        return _combine_jnp(act, w_down, group_sizes, token, init, tokens, tm,
                            weight).astype(out_dtype)
    t_pad = vmem_rows.pad_block(tokens)
    with_init = init is not None
    cols = column_width(tokens, hidden, tm, inter, act.dtype.itemsize, out_dtype.itemsize,
                        vmem_limit)
    if cols is None:
        raise ValueError(f"{tokens} x {hidden} sums ({out_dtype}) do not fit "
                         f"{vmem_rows.budgets(vmem_limit)[0]} bytes of VMEM 128 columns at "
                         "a time")
    (offsets, group_ids, m_tiles), active, max_tiles = tile_schedule(group_sizes, m_pad, tm)
    tiles_n = hidden // cols
    if cast:  # written by the kernel's own DMAs, through the staging buffer
        sums = pl.BlockSpec(memory_space=pl.ANY)
    else:
        sums = pl.BlockSpec((t_pad, cols), lambda n, t, *_: (0, n),
                            pipeline_mode=pl.Buffered(1))
    in_specs = [pl.BlockSpec((tm, inter), lambda n, t, o, g, mt, *_: (mt[t], 0)),
                pl.BlockSpec((None, inter, cols), lambda n, t, o, g, mt, *_: (g[t], 0, n))]
    # Prefetched to SMEM: the tile schedule, each row's token, (weighing) its weight and
    # (with init) whether init is read.
    scalars = [offsets, group_ids, m_tiles, token] + ([] if weight is None else [weight])
    operands = [act, w_down]
    scratch = [pltpu.VMEM((tm, cols), jnp.float32)]
    if cast:
        scratch += [pltpu.VMEM((t_pad, cols), jnp.float32),
                    pltpu.VMEM((2, stage_rows(t_pad), cols), out_dtype)]
    if with_init:  # copied by the kernel itself (none on a first pass)
        scalars.append(jnp.asarray(reads_init, jnp.int32).reshape(1))
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(jnp.pad(init, ((0, t_pad - tokens), (0, 0))))
    if with_init or cast:  # one per staging buffer
        scratch.append(pltpu.SemaphoreType.DMA((2,)))
    item = act.dtype.itemsize
    per_row = 1 if weight is None else 2  # the int32 token and float32 weight scalars
    cost = pl.CostEstimate(  # static, whatever the routing (module docstring, "Cost")
        flops=2 * m_pad * inter * hidden, transcendentals=0,
        bytes_accessed=(m_pad * inter * item * tiles_n + groups * inter * hidden * item
                        + t_pad * hidden * out_dtype.itemsize
                        + (m_pad * per_row + 2 * max_tiles + groups + 1) * 4))
    with jax_config._check_vma(False):
        out = pl.pallas_call(
            functools.partial(_kernel, with_init=with_init, weighted=weight is not None,
                              cast=cast),
            out_shape=jax.ShapeDtypeStruct((t_pad, hidden), out_dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(scalars),
                # At least one step, so the sums are written even with no row to add
                # (the step's group is then empty: nothing is added).
                grid=(tiles_n, jnp.maximum(active, 1)),
                in_specs=in_specs, out_specs=sums, scratch_shapes=scratch),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=vmem_limit),
            cost_estimate=cost,
            interpret=interpret,
            # The sums are updated in place of init (a column block is read before it is
            # written back, and never read again): under EP the passes' loop-carried sums
            # need no copy per pass (when the tokens are a whole number of 16-row blocks;
            # otherwise init is padded and the result sliced, each a copy).
            input_output_aliases={len(scalars) + 2: 0} if with_init else {},
        )(*scalars, *operands)
    out = mark_varying(out, act, w_down, group_sizes, token)
    return out[:tokens] if t_pad != tokens else out


def _combine_jnp(act: jax.Array, w_down: jax.Array, group_sizes: jax.Array,
                 token: jax.Array, init: jax.Array | None, tokens: int, tm: int,
                 weight: jax.Array | None) -> jax.Array:
    """:func:`down_and_combine`'s arithmetic without the kernel: Megablox's down in float32
    (interpret mode), its rows inside the groups (times their weights) scatter-added at
    their tokens; float32."""
    groups, inter, hidden = w_down.shape
    with jax_config._check_vma(False):
        rows = megablox_gmm(act, w_down, group_sizes, preferred_element_type=jnp.float32,
                            tiling=(tm, inter, hidden), interpret=True)
    rows = mark_varying(rows, act, w_down, group_sizes)
    inside = jnp.arange(act.shape[0]) < jnp.sum(group_sizes)
    if weight is not None:
        rows = rows * weight[:, None]
    kept = jnp.where(inside[:, None], rows, 0.0)  # rows past the groups: unspecified
    start = (init.astype(jnp.float32) if init is not None
             else jnp.zeros((tokens, hidden), jnp.float32))
    return start.at[jnp.where(inside, token, 0)].add(kept)
