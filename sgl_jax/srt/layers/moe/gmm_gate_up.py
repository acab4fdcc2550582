"""The gmm backend's gate and up projections and the gated activation in one Pallas TPU kernel.

Without it, gate and up are two Megablox ``gmm`` calls that each read the ``[M_pad, H]``
sorted token rows and write a float32 ``[M_pad, I]`` result, and XLA reads both back to form
``silu(gate) * up * routing weight`` in the compute dtype. Here each grid step reads one m
tile of the rows ``[tm, H]`` once, multiplies it by its group's gate and up weight blocks
``[H, tn]`` (accumulating in float32 on the MXU), and stores
``(silu(gate) * up).astype(dtype)`` (times the routing weight where the combine does not
apply it: ``gmm_combine.weighs_rows``): the rows are read once, and the only
``[M_pad, I]`` array written is the activation down reads. At decode, where the tokens
``[T, H]`` fit VMEM whole, the kernel holds them and picks each tile's rows itself
(``vmem_rows.pick_rows``): the sorted ``[M_pad, H]`` rows are never written at all.

The grid is ``(n tiles of I, m tiles of some group)`` from Megablox's group metadata (a tile
shared by two groups is visited once per group, consecutively: the output block stays in
VMEM between the visits and each visit stores only its group's rows, as Megablox's store
mask does). Rows past the groups are unspecified (a partly owned tile stores them back
with whatever its buffer held); the caller reads only rows inside the groups.

Cost: as ``gmm_combine``'s (its docstring, "Cost"): the rows once per n tile of I, each
group's two weight blocks once, the activation once, and the routing weight column (if
any) as the kernel's blocks move it (``[M_pad, 1]`` float32 is laid out 128 lanes wide in
HBM). FLOPs are
``4 * M_pad * H * I``, Megablox's convention: the MXU also multiplies the other rows of a
partly owned tile, up to ``(M_pad / tm + G - 1) / (M_pad / tm)`` times that at decode.

At prefill, where the tokens do not fit VMEM, the kernel fetches each tile's rows from HBM
itself, one DMA per row by the token index in SMEM, the next tile's rows copied while the
MXU works on this one (two slots): the sorted ``[M_pad, H]`` rows are never written either,
and x is read once per row that uses it. Mosaic cannot DMA a single row of a packed bfloat16
array (its row is half of a 32-bit sublane; "offsets along tiled dimensions must be aligned
to tiles"), so bfloat16 tokens are first packed two columns to a 32-bit word (column ``j``
in the low half, ``j + H / 2`` in the high half: one XLA fusion reading and writing ``[T,
H]`` once), whose rows DMA like float32 rows, and unpacked in VMEM by shifts (exact: a
bfloat16 is the high half of the float32 of the same value; a chip flushing float32
subnormals to zero would zero bfloat16 subnormals, below 1.2e-38, as well).

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
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

from sgl_jax.srt.layers.moe import vmem_rows
from sgl_jax.srt.layers.moe.gmm_combine import tile_schedule
from sgl_jax.srt.layers.moe.manual_axes import mark_varying

# VMEM of the pipelined blocks: the row tile (or, gathering, the held tokens and the tile
# assembled from them), both weight blocks and the output block, each double-buffered. tn
# (a lane tile of I) shrinks until they fit. Fetching its rows by DMA, the kernel may use all
# of ``vmem_rows.KERNEL_BUDGET``: a narrower tn would fetch every row once more per tile.
BLOCKS_BUDGET = 24 * 1024 * 1024
FETCH_BUDGET = vmem_rows.KERNEL_BUDGET

UNPACK_ROWS = 16  # rows unpacked at a time (a bfloat16 sublane tile; every tm is a multiple)

# How the kernel gets its tile of rows: "rows" given sorted ([M_pad, H], gathered by the
# caller), "hold" picked from the tokens held whole in VMEM, "fetch" copied by row DMAs from
# the tokens in HBM.
ROWS, HOLD, FETCH = "rows", "hold", "fetch"


def _vmem(tm: int, hidden: int, tn: int, itemsize: int, mode: str = ROWS,
          held_tokens: int = 0) -> int:
    """VMEM of one tiling: the rows (two pipeline buffers; or the held tokens, their float32
    copy and the picked tile; or two DMA slots and, packed, the unpacked tile), two weight
    blocks and the output block double-buffered, the routing-weight column (double-buffered,
    128 lanes wide) and the two float32 products."""
    if mode == HOLD:
        rows = held_tokens * hidden * vmem_rows.held_bytes(itemsize) + tm * hidden * itemsize
    elif mode == FETCH:  # two slots; packed: the unpacked tile and one chunk's temporaries
        rows = 2 * tm * hidden * itemsize + (
            tm * hidden * itemsize + UNPACK_ROWS * hidden * 8 if itemsize == 2 else 0)
    else:
        rows = 2 * tm * hidden * itemsize
    return (rows + 2 * (2 * hidden * tn + tm * tn) * itemsize + 2 * tm * vmem_rows.LANE * 4
            + 2 * tm * tn * 4)


def column_tile(tm: int, hidden: int, inter: int, itemsize: int, mode: str = ROWS,
                held_tokens: int = 0) -> int | None:
    """The widest lane tile of I whose blocks fit the mode's budget (None: none does), with
    ``held_tokens`` tokens held to gather from (mode "hold")."""
    budget = FETCH_BUDGET if mode == FETCH else BLOCKS_BUDGET
    held = vmem_rows.pad_block(held_tokens)
    return next((t for t in vmem_rows.lane_tiles(inter)
                 if _vmem(tm, hidden, t, itemsize, mode, held) <= budget), None)


def holds_tokens(tokens: int, hidden: int, itemsize: int, rows: int) -> bool:
    """Whether the kernel can hold all ``tokens`` rows of x whole (decode) and gather its
    ``rows`` tile rows from them itself (``vmem_rows``' budget and index limit)."""
    t_pad = vmem_rows.pad_block(tokens)
    return (vmem_rows.fits(t_pad, hidden, itemsize, rows)
            and vmem_rows.column_block(t_pad, hidden, vmem_rows.held_bytes(itemsize)) == hidden)


def packs(dtype: jnp.dtype, hidden: int) -> bool:
    """Whether the row DMAs read ``[T, hidden]`` rows of ``dtype`` packed two columns to a
    word (:func:`pack_pairs`): bfloat16 with ``hidden / 2`` a multiple of 128 lanes."""
    return jnp.dtype(dtype) == jnp.bfloat16 and hidden % (2 * vmem_rows.LANE) == 0


def fetchable(dtype: jnp.dtype, hidden: int, rows: int) -> bool:
    """Whether the kernel can DMA its ``rows`` tile rows of a ``[T, hidden]`` x itself: 32-bit
    rows as they are, bfloat16 rows packed (:func:`packs`); the row indices within SMEM's
    ``vmem_rows.MAX_INDICES``."""
    return ((jnp.dtype(dtype).itemsize == 4 or packs(dtype, hidden))
            and rows <= vmem_rows.MAX_INDICES)


def token_mode(tokens: int, hidden: int, inter: int, dtype: jnp.dtype, rows: int,
               tm: int) -> str | None:
    """How :func:`gate_up_act` takes its ``rows`` rows from the ``[tokens, hidden]`` x itself:
    "hold" (x fits VMEM whole: decode), else "fetch" (row DMAs: prefill); None: neither fits
    (the caller gathers the sorted rows)."""
    item = jnp.dtype(dtype).itemsize
    if (holds_tokens(tokens, hidden, item, rows)
            and column_tile(tm, hidden, inter, item, HOLD, tokens) is not None):
        return HOLD
    if fetchable(dtype, hidden, rows) and column_tile(tm, hidden, inter, item, FETCH):
        return FETCH
    return None


def pack_pairs(x: jax.Array) -> jax.Array:
    """bfloat16 ``[T, H]`` -> uint32 ``[T, H / 2]``: column ``j`` in the low 16 bits, column
    ``j + H / 2`` in the high 16 bits (:func:`_unpack_pairs` inverts it in VMEM)."""
    half = x.shape[1] // 2

    def bits(half_columns: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(half_columns, jnp.uint16).astype(jnp.uint32)

    # Sliced before the bitcast: one XLA:TPU fusion reading x once and writing the words
    # once (compile-only v6e, [8192, 2048]: 67 MB; bitcasting x whole first, 201 MB in two).
    return bits(x[:, :half]) | (bits(x[:, half:]) << 16)


def fetch_source(x: jax.Array) -> jax.Array:
    """The array the "fetch" mode DMAs rows of: x's rows packed in pairs of columns
    (:func:`pack_pairs`) for bfloat16, x itself for 32-bit rows. A caller running several
    passes over the same x packs it once and passes it as ``gate_up_act``'s ``words``."""
    return pack_pairs(x) if x.dtype == jnp.bfloat16 else x


def _unpack_pairs(words: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """uint32 ``[tm, H / 2]`` -> ``[tm, H]`` in bfloat16, exactly :func:`pack_pairs`' input:
    each half moved to the high bits of a float32 is that bfloat16's value."""
    low = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    high = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.concatenate([low, high], axis=1).astype(dtype)


def _act(rows: jax.Array, gate_ref, up_ref, weight_ref, out_ref, offsets_ref, groups_ref,
         m_tiles_ref, contract_minor: bool) -> None:
    """Stores the gated activation of the step's tile ``rows`` [tm, H] for its group's rows
    (times the routing weight column, if ``weight_ref`` is not None)."""
    step = pl.program_id(1)
    tm = rows.shape[0]
    dims = (((1,), (1,)), ((), ())) if contract_minor else (((1,), (0,)), ((), ()))
    gate = jax.lax.dot_general(rows, gate_ref[...], dims, preferred_element_type=jnp.float32)
    up = jax.lax.dot_general(rows, up_ref[...], dims, preferred_element_type=jnp.float32)
    act = jax.nn.silu(gate) * up
    if weight_ref is not None:
        act = act * weight_ref[...]
    act = act.astype(out_ref.dtype)
    group = groups_ref[step]
    row = m_tiles_ref[step] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    mine = (row >= offsets_ref[group]) & (row < offsets_ref[group + 1])
    out_ref[...] = jnp.where(mine, act, out_ref[...])


def _weight_and_rest(refs: tuple, weighted: bool) -> tuple:
    """The kernel's refs after the weights: (the routing weight column or None, the rest)."""
    return (refs[0], refs[1:]) if weighted else (None, refs)


def _rows_kernel(offsets_ref, groups_ref, m_tiles_ref, xs_ref, gate_ref, up_ref, *refs,
                 contract_minor: bool, weighted: bool):
    weight_ref, (out_ref,) = _weight_and_rest(refs, weighted)
    _act(xs_ref[...], gate_ref, up_ref, weight_ref, out_ref, offsets_ref, groups_ref,
         m_tiles_ref, contract_minor)


def _gather_kernel(offsets_ref, groups_ref, m_tiles_ref, token_ref, x_ref, gate_ref, up_ref,
                   *refs, contract_minor: bool, weighted: bool):
    weight_ref, (out_ref, xf_ref, rows_ref) = _weight_and_rest(refs, weighted)
    # The tokens' rows are held whole (their block index never changes: read from HBM once)
    # with a float32 copy made at the first step, from which the tile's rows are picked by
    # a dynamic sublane offset (vmem_rows' module docstring says why float32).
    @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
    def _():
        xf_ref[...] = x_ref[...].astype(jnp.float32)

    step = pl.program_id(1)
    tile = m_tiles_ref[step]

    # A tile shared by two groups is visited twice in a row: its rows are picked once.
    @pl.when((step == 0) | (tile != m_tiles_ref[jnp.maximum(step - 1, 0)]))
    def _():
        vmem_rows.pick_rows(xf_ref, token_ref, tile * rows_ref.shape[0], rows_ref)

    _act(rows_ref[...], gate_ref, up_ref, weight_ref, out_ref, offsets_ref, groups_ref,
         m_tiles_ref, contract_minor)


def _row_copy(x_hbm, slots, sems, slot, row: int | jax.Array, token: int | jax.Array):
    """The DMA of token row ``token`` of x (in HBM) into row ``row`` of DMA slot ``slot``."""
    return pltpu.make_async_copy(x_hbm.at[pl.ds(token, 1)], slots.at[slot, pl.ds(row, 1)],
                                 sems.at[slot])


def _fetch_tile(token_ref, x_hbm, slots, sems, tile: jax.Array, slot: jax.Array) -> None:
    """Starts the DMAs of m tile ``tile``'s rows into ``slot`` (one per row, one semaphore)."""
    tm = slots.shape[1]

    def start(r, carry):
        _row_copy(x_hbm, slots, sems, slot, r, token_ref[tile * tm + r]).start()
        return carry

    jax.lax.fori_loop(0, tm, start, 0, unroll=8)


def _wait_tile(x_hbm, slots, sems, slot: jax.Array) -> None:
    """Waits for the ``tm`` row DMAs of ``slot`` (a wait per copy, of a copy's size)."""
    def wait(r, carry):
        _row_copy(x_hbm, slots, sems, slot, r, 0).wait()
        return carry

    jax.lax.fori_loop(0, slots.shape[1], wait, 0, unroll=8)


def _unpack_tile(slots, slot: jax.Array, rows_ref) -> None:
    """Slot ``slot``'s packed words into ``rows_ref`` [tm, H], ``UNPACK_ROWS`` rows at a
    time (the float32 temporaries of a whole tile would not fit VMEM next to the blocks at
    the widest models)."""
    def chunk(c, carry):
        first = pl.multiple_of(c * UNPACK_ROWS, UNPACK_ROWS)
        rows_ref[pl.ds(first, UNPACK_ROWS), :] = _unpack_pairs(
            slots[slot, pl.ds(first, UNPACK_ROWS), :], rows_ref.dtype)
        return carry

    jax.lax.fori_loop(0, rows_ref.shape[0] // UNPACK_ROWS, chunk, 0)


def _fetch_kernel(offsets_ref, groups_ref, m_tiles_ref, token_ref, x_hbm, gate_ref, up_ref,
                  *refs, contract_minor: bool, weighted: bool):
    weight_ref, (out_ref, slots, sems, *unpacked) = _weight_and_rest(refs, weighted)
    # Each n tile visits m tiles 0, 1, ..., last in order (the groups cover rows [0, sum)
    # contiguously; a tile shared by groups is visited once per group, consecutively), so
    # the k-th distinct tile of the whole grid is seq = n * (last + 1) + tile and lives in
    # slot seq % 2; when it is first visited its rows are waited for and the next distinct
    # tile's (the first tile of the next n tile, after the last) are started into the other
    # slot, so that copy overlaps this tile's matmuls.
    n, step = pl.program_id(0), pl.program_id(1)
    tile = m_tiles_ref[step]
    last = m_tiles_ref[pl.num_programs(1) - 1]
    seq = n * (last + 1) + tile
    slot = seq % 2

    @pl.when((step == 0) | (tile != m_tiles_ref[jnp.maximum(step - 1, 0)]))
    def _():
        @pl.when(seq == 0)
        def _():
            _fetch_tile(token_ref, x_hbm, slots, sems, tile, slot)

        _wait_tile(x_hbm, slots, sems, slot)

        @pl.when(seq + 1 < pl.num_programs(0) * (last + 1))
        def _():
            _fetch_tile(token_ref, x_hbm, slots, sems, jnp.where(tile == last, 0, tile + 1),
                        1 - slot)

        if unpacked:  # bfloat16 rows, packed in pairs (pack_pairs)
            _unpack_tile(slots, slot, unpacked[0])

    rows = unpacked[0][...] if unpacked else slots[slot]
    _act(rows, gate_ref, up_ref, weight_ref, out_ref, offsets_ref, groups_ref, m_tiles_ref,
         contract_minor)


@functools.partial(jax.jit, static_argnames=("tm", "contract_minor", "interpret"))
def gate_up_act(x: jax.Array, token: jax.Array | None, w_gate: jax.Array, w_up: jax.Array,
                weight: jax.Array | None, group_sizes: jax.Array, tm: int, contract_minor: bool,
                interpret: bool, words: jax.Array | None = None) -> jax.Array:
    """``[M_pad, I]`` in x's dtype: ``silu(r @ w_gate[g]) * (r @ w_up[g]) * weight`` for each
    sorted row r inside the groups (g its group; products in float32, one rounding at the
    end; without ``weight``, not multiplied: the combine weighs the rows,
    ``gmm_combine.weighs_rows``); rows past ``sum(group_sizes)`` unspecified.

    Without ``token``, x is the sorted rows ``[M_pad, H]``; with it ([M_pad] int32), x is the
    tokens ``[T, H]`` and row m is ``x[token[m]]``, taken by the kernel itself
    (:func:`token_mode`: picked from x held whole in VMEM, or copied from HBM by row DMAs).
    ``M_pad`` a multiple of ``tm``; w_gate, w_up [G, H, I]; weight [M_pad] float32;
    group_sizes [G] from row 0; ``contract_minor``: the weights are laid out K-minor
    (``gmm.k_minor``). The caller checks :func:`column_tile` (rows given) or
    :func:`token_mode`. ``words``: :func:`fetch_source` of x, if the caller has it."""
    hidden = x.shape[1]
    m_pad = x.shape[0] if token is None else token.shape[0]
    groups, _, inter = w_gate.shape
    group_sizes = group_sizes.astype(jnp.int32)
    if weight is not None:
        weight = weight.astype(jnp.float32).reshape(m_pad, 1)
    if interpret and vmem_rows.under_manual_axes(x, w_gate):
        xs = x if token is None else jnp.take(x, token, axis=0)
        return _gate_up_jnp(xs, w_gate, w_up, weight, group_sizes, tm)
    item = x.dtype.itemsize
    mode = ROWS if token is None else token_mode(x.shape[0], hidden, inter, x.dtype, m_pad, tm)
    t_pad = vmem_rows.pad_block(x.shape[0]) if mode == HOLD else 0
    tn = None if mode is None else column_tile(tm, hidden, inter, item, mode, t_pad)
    if m_pad % tm or tn is None:
        raise ValueError(f"gate_up_act: {m_pad} rows by tm={tm}, H={hidden}, I={inter}: the "
                         f"rows must be a multiple of tm and the blocks fit VMEM")
    (offsets, group_ids, m_tiles), active, max_tiles = tile_schedule(group_sizes, m_pad, tm)
    # Index maps see the grid indices, then the scalar-prefetched arrays (the metadata and,
    # taking the rows from the tokens, the tokens).
    if contract_minor:  # the K-minor layout read as it is stored (a bitcast, no copy)
        w_gate, w_up = w_gate.swapaxes(1, 2), w_up.swapaxes(1, 2)
        w_block = pl.BlockSpec((None, tn, hidden), lambda n, t, o, g, mt, *_: (g[t], n, 0))
    else:
        w_block = pl.BlockSpec((None, hidden, tn), lambda n, t, o, g, mt, *_: (g[t], 0, n))
    out_spec = pl.BlockSpec((tm, tn), lambda n, t, o, g, mt, *_: (mt[t], n))
    dtype = x.dtype
    if mode == ROWS:
        kernel, scalars, scratch = _rows_kernel, (offsets, group_ids, m_tiles), []
        rows = pl.BlockSpec((tm, hidden), lambda n, t, o, g, mt: (mt[t], 0))
        rows_bytes = m_pad * hidden * item * (inter // tn)
    elif mode == HOLD:
        x = jnp.pad(x, ((0, t_pad - x.shape[0]), (0, 0)))
        kernel, scalars = _gather_kernel, (offsets, group_ids, m_tiles, token.astype(jnp.int32))
        scratch = [pltpu.VMEM((t_pad, hidden), jnp.float32), pltpu.VMEM((tm, hidden), dtype)]
        rows = pl.BlockSpec((t_pad, hidden), lambda *_: (0, 0))
        rows_bytes = t_pad * hidden * item + m_pad * 4
    else:  # FETCH: every row once per column tile of I, and the indices
        packed = item == 2
        x = fetch_source(x) if words is None else words
        kernel, scalars = _fetch_kernel, (offsets, group_ids, m_tiles, token.astype(jnp.int32))
        scratch = [pltpu.VMEM((2, tm, x.shape[1]), x.dtype), pltpu.SemaphoreType.DMA((2,))]
        scratch += [pltpu.VMEM((tm, hidden), dtype)] if packed else []
        rows = pl.BlockSpec(memory_space=pl.ANY)
        rows_bytes = m_pad * hidden * item * (inter // tn) + m_pad * 4
    in_specs, operands = [rows, w_block, w_block], [x, w_gate, w_up]
    if weight is not None:  # a [tm, 1] float32 block, laid out 128 lanes wide in HBM
        in_specs.append(pl.BlockSpec((tm, 1), lambda n, t, o, g, mt, *_: (mt[t], 0)))
        operands.append(weight)
    weight_bytes = 0 if weight is None else m_pad * vmem_rows.LANE * 4 * (inter // tn)
    cost = pl.CostEstimate(  # static, whatever the routing (gmm_combine's docstring, "Cost")
        flops=4 * m_pad * hidden * inter, transcendentals=m_pad * inter,
        bytes_accessed=(rows_bytes + 2 * groups * hidden * inter * item + m_pad * inter * item
                        + weight_bytes + (2 * max_tiles + groups + 1) * 4))
    with jax_config._check_vma(False):
        out = pl.pallas_call(
            functools.partial(kernel, contract_minor=contract_minor,
                              weighted=weight is not None),
            out_shape=jax.ShapeDtypeStruct((m_pad, inter), dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(scalars),
                grid=(inter // tn, active),
                in_specs=in_specs,
                out_specs=out_spec, scratch_shapes=scratch),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("arbitrary", "arbitrary"),
                vmem_limit_bytes=vmem_rows.VMEM_LIMIT),
            cost_estimate=cost,
            interpret=interpret,
        )(*scalars, *operands)
    return mark_varying(out, x, w_gate, group_sizes)


def _gate_up_jnp(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                 weight: jax.Array | None, group_sizes: jax.Array, tm: int) -> jax.Array:
    """:func:`gate_up_act`'s arithmetic without the kernel: Megablox's gate and up in
    float32 (interpret mode), the activation in float32, one rounding."""
    _, hidden, inter = w_gate.shape
    with jax_config._check_vma(False):
        gate, up = (megablox_gmm(xs, w, group_sizes, preferred_element_type=jnp.float32,
                                 tiling=(tm, hidden, inter), interpret=True)
                    for w in (w_gate, w_up))
    gate, up = (mark_varying(a, xs, w_gate, group_sizes) for a in (gate, up))
    act = jax.nn.silu(gate) * up
    return (act if weight is None else act * weight).astype(xs.dtype)
