"""The ``gmm`` expert backend: dropless grouped matmuls as Pallas TPU kernels.

Same computation as ``ragged`` (``ragged.py``), with the grouped matmuls done by Pallas
kernels on the tile schedule of JAX's Megablox ``gmm``
(``jax.experimental.pallas.ops.tpu.megablox``) instead of ``jax.lax.ragged_dot``:

1. the ``M = T * k`` assignments are sorted by expert row (``ragged.sorted_assignments``: the
   sentinel row ``E_l`` of experts held elsewhere sorts last and is counted in no group),
   their token indices padded to ``M_pad``, a multiple of the row tile ``tm`` (the kernels
   tile rows in whole ``tm`` blocks); padded rows are past ``sum(group_sizes)``, like the
   sentinel rows, so no group holds them;
2. gate and up are one kernel (``gmm_gate_up.gate_up_act``): each m tile of the sorted rows
   is taken from x by the kernel itself (picked from x held whole in VMEM at decode, copied
   from HBM one row DMA each at prefill), multiplied by its group's gate and up weight
   blocks in float32, and stored as ``silu(gate) * up`` in the compute dtype: the sorted
   ``[M_pad, H]`` rows are never written. Where the kernel
   cannot take them itself (a dtype or width its DMAs do not handle), the rows are gathered
   first, by a Pallas kernel that holds a column block of ``x`` in VMEM
   (``vmem_rows.gather_rows``, up to 24,576 tokens of a 2,048-wide model) or by XLA's
   gather of whole tiles (:func:`take_rows`); where its blocks do not fit VMEM at all, two
   Megablox ``gmm`` calls (:func:`gmm_tiling`) stored in float32 and the same activation in
   XLA;
3. down and the combine are one kernel (``gmm_combine.down_and_combine``) where the float32
   ``[T, H]`` sums fit VMEM 128 columns at a time (32k tokens, 16k when they start from
   earlier passes' sums) and the rows ``vmem_rows.MAX_INDICES``: each m tile's rows of
   its group are multiplied by the group's weights and added, in float32, straight into
   their token's sum, so down's ``[M, H]`` rows never reach HBM; rows past the groups
   (sentinel, padding) are never added. Each row is multiplied by its routing weight as it
   is added, a float32 scalar from SMEM (``gmm_combine.weighs_rows``: up to 65,536 rows;
   beyond, gate/up multiplies its activation by a ``[M_pad, 1]`` float32 column, which
   HBM lays out 128 lanes wide). The kernel writes the sums rounded once (per pass: see
   "Passes") to the dtype its caller moves them in (the activation dtype under sequence
   parallelism and DP attention), not a float32 array XLA reads back to cast. Beyond
   that, down is a third ``gmm`` call stored in the compute dtype and
   :func:`sum_token_rows` puts its rows back in ``[T, k]`` order (a gather through the
   inverse permutation), drops the assignments held elsewhere with a
   select on ``local_ids`` (the kernel does not store the rows of a partly visited tile that
   belong to no group: those rows hold whatever the output buffer held, maybe NaN) and sums
   the k rows of each token in float32.

Routing is computed before the backend (float32 router): the compute-dtype intermediates
change the rounding of the MoE output, never which experts a token was routed to in this
layer. With a float32 model every intermediate is float32, as in ``ragged``.

Megablox's grid has one step per (n tile, m tile of some group, k tile), and the number of
m tiles is data (the fused kernels share its tile schedule, with one k tile): tiles holding
only sentinel or padding rows are skipped at run time (under EP most of the ``M`` rows of a
device are the sentinel). Its cost estimate (what XLA's
``cost_analysis`` adds for the custom call) is static: ``2 * M_pad * K * N`` FLOPs and
``lhs_bytes * N / tn + K * N * itemsize * (M_pad / tm + E_l - 1) + M_pad * N * 4`` bytes
(one [K, N] weight block per possible m tile, the LHS once per n tile). The fused kernels'
estimates count each group's weights once per n tile (``gmm_combine``'s docstring, "Cost").

Passes. Under expert parallelism (``shards`` > 1: the "expert" mesh axis, with or without
DP attention) a device holds ``E_l = E / shards`` experts and, routing being balanced, about
``M / shards`` of the ``M`` assignments it sorts (the rest carry the sentinel and sort last).
Shapes sized for all ``M`` would gather, multiply (by the kernel's static estimate) and sum
``shards`` times the rows a device has. So its assignments are computed in passes over a
window of ``W`` sorted positions, ``CAPACITY_FACTOR * M / shards`` (:func:`pass_rows`) padded
to the row tile, window ``p`` holding positions ``[p * W, (p + 1) * W)``: the groups are
clipped to the window (a group may span two), and each pass adds its rows into the sums of
the passes before (the combine kernel starts from them), carried between passes in the
output dtype: with one pass (the rule) the sums are added in float32 and rounded once, as
without EP; a second pass rounds them once more (bfloat16 under DP attention: the
loop-carried ``[T, H]`` sums are half the bytes to initialise, read and write, and no
float32 array is cast after the loop). The number of passes is data (a ``while_loop``: one
unless a device gets more than ``CAPACITY_FACTOR`` times its share), so no assignment is
ever dropped and the result is the same whatever the factor, up to the order and rounding
of the additions. XLA's cost analysis counts a ``while_loop`` body
once: the estimates of ``aot_report`` are one pass.

Gate and up are fused without concatenating their weights (the model stores them as two
arrays: a concatenation inside the step would copy both projections' weights every step):
the kernel takes both weight arrays and reads two blocks per m tile.

Off TPU the kernel runs in Pallas interpret mode (slow, for tests): the platform is the one
the program is compiled for (:func:`interpret_on`), which the runner passes in.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax._src import config as jax_config  # _check_vma: see grouped_matmul
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

from sgl_jax.srt.layers.moe import gmm_combine, gmm_gate_up, vmem_rows
from sgl_jax.srt.layers.moe.activation import SILU, ExpertActivation
from sgl_jax.srt.layers.moe.manual_axes import mark_varying
from sgl_jax.srt.layers.moe.ragged import sorted_assignments

# VMEM the kernel's blocks may use: double-buffered lhs [tm, tk] and rhs [tk, tn] input
# blocks, the double-buffered float32 output block [tm, tn] and the float32 accumulator. Below
# the smallest default scoped VMEM limit of the TPUs we target (16 MiB on v5e / v5p; v6e has
# 32 MiB), leaving room for Mosaic's own scratch.
VMEM_BUDGET = 12 * 1024 * 1024
ROW_TILES = (512, 256, 128, 64, 32, 16)  # tm candidates: multiples of 16 (bf16 sublane packing)
LANE = 128  # tk / tn must be multiples of the lane width, or the whole dimension
# Roofline of one chip used to weigh the tiles' bytes against their padded MXU work: v6e
# (918 TFLOP/s bf16, 1.64 TB/s HBM), the chip the table of docs/moe_backends.md is for. With
# v5p's figures (459e12, 2.765e12: less compute per byte) the rule picks tm one step smaller
# at 7 of the table's 12 shapes; the tiles are not chosen per chip (yet).
PEAK_FLOPS = 918e12
HBM_BANDWIDTH = 1.64e12
STEP_SECONDS = 0.35e-6  # fixed cost of one Pallas TPU grid step (pipeline bookkeeping)
TIE = 0.05  # modelled times within 5% of the best are a tie
# Rows of one pass under expert parallelism, in units of the device's even share of the
# assignments (module docstring, "Passes"). XLA's static estimates count one window's rows
# (1.25x the ideal expert FLOPs); a device routed more than that takes another pass, whose
# kernels visit only the tiles holding its rows (their grids are data) at the cost of one
# more read and write of the float32 sums.
CAPACITY_FACTOR = 1.25


def vmem_bytes(tm: int, tk: int, tn: int, itemsize: int) -> int:
    """VMEM of one tiling: 2 lhs + 2 rhs input blocks, 2 float32 output blocks, 1 accumulator."""
    return 2 * (tm * tk + tk * tn) * itemsize + 3 * tm * tn * 4


def pad_rows(m: int, tm: int) -> int:
    return -(-m // tm) * tm


def estimate(m: int, k: int, n: int, groups: int, tiling: tuple[int, int, int],
             itemsize: int) -> dict[str, float]:
    """One gmm call's cost at tiling (tm, tk, tn), rows padded to a multiple of tm.

    - ``bytes`` and ``flops``: the kernel's own ``CostEstimate`` (what XLA's cost analysis
      reports for the custom call): the LHS once per n tile, one group's [K, N] weights per
      m tile the grid may visit (``M_pad / tm + groups - 1``: a group starting inside a tile
      visits it again), the float32 output once; ``2 * M_pad * K * N`` FLOPs.
    - ``pipelined_bytes``: what the pipeline fetches. Pallas skips a block's copy when its
      index is unchanged from the previous grid step; with one k tile (tk = K) the weight
      block of consecutive m tiles of the same group is the same, so the weights are read
      once per n tile (``groups * K * N``), not once per m tile as the estimate assumes.
    - ``mxu_flops``: the padded work of the most m tiles the grid can visit (whole tiles
      are computed whatever rows they hold: at decode most of a tile is other groups' rows).
    - ``steps``: grid steps at most (n tiles x m tiles x k tiles).
    """
    tm, tk, tn = tiling
    m_pad = pad_rows(m, tm)
    tiles_n, tiles_k = -(-n // tn), -(-k // tk)
    max_tiles = m_pad // tm + groups - 1
    lhs_bytes = m_pad * k * itemsize
    rhs_bytes = k * n * itemsize
    out_bytes = m_pad * n * 4
    weight_reads = groups if tiles_k == 1 else max_tiles
    return {
        "bytes": lhs_bytes * tiles_n + rhs_bytes * max_tiles + out_bytes,
        "pipelined_bytes": lhs_bytes * tiles_n + rhs_bytes * weight_reads + out_bytes,
        "flops": 2 * m_pad * k * n,
        "mxu_flops": 2 * max_tiles * tm * k * n,
        "steps": tiles_n * max_tiles * tiles_k,
        "vmem": vmem_bytes(tm, tk, tn, itemsize),
    }


def modelled_seconds(cost: dict[str, float]) -> float:
    """Roofline time of one call: the kernel's estimated bytes or its padded MXU work,
    whichever is larger, plus the fixed cost of each grid step (``STEP_SECONDS``). The
    estimate is an upper bound of the bytes (``pipelined_bytes`` is lower with tk = K) and is
    what XLA's cost analysis, hence ``aot_report``, counts."""
    roofline = max(cost["bytes"] / HBM_BANDWIDTH, cost["mxu_flops"] / PEAK_FLOPS)
    return roofline + cost["steps"] * STEP_SECONDS


@functools.cache
def gmm_tiling(m: int, k: int, n: int, groups: int, itemsize: int = 2) -> tuple[int, int, int]:
    """The (tm, tk, tn) of a gmm of [m, k] rows by [groups, k, n] weights.

    The rule (measured with ``benchmarks/bench_gmm_tiles.py``, table in
    ``docs/moe_backends.md``): among the tilings that fit ``VMEM_BUDGET`` (tk, tn: the whole
    dimension or a multiple of 128 dividing it; tm: 16..512, at most the padded rows), the one
    with the least modelled time (:func:`modelled_seconds`); times within ``TIE`` of the best
    are a tie, broken by the least padded MXU work, then by the larger tk, tn, tm. In
    practice: tk = K (one k step: a group's weight block is fetched once for all its
    consecutive m tiles) unless VMEM forbids it, tn = N unless the float32 output block does
    not fit, tm smaller at decode (most groups hold a few rows: a large tile is mostly
    padding) than in prefill.
    """
    candidates: list[tuple[float, float, tuple[int, int, int]]] = []
    row_cap = pad_rows(m, 16)
    for tk in vmem_rows.lane_tiles(k):
        for tn in vmem_rows.lane_tiles(n):
            for tm in ROW_TILES:
                if tm > row_cap and tm != ROW_TILES[-1]:
                    continue
                if vmem_bytes(tm, tk, tn, itemsize) > VMEM_BUDGET:
                    continue
                cost = estimate(m, k, n, groups, (tm, tk, tn), itemsize)
                candidates.append((modelled_seconds(cost), cost["mxu_flops"], (tm, tk, tn)))
    if not candidates:
        raise ValueError(f"no gmm tiling fits {VMEM_BUDGET} bytes of VMEM for "
                         f"(m, k, n) = ({m}, {k}, {n})")
    # The model is a roofline, good to a few percent: among the tilings within TIE of the
    # best, the least padded MXU work (keeps the MXU off the critical path where the model
    # cannot tell), then the first (larger tk, tn, tm).
    fastest = min(c[0] for c in candidates)
    near = [c for c in candidates if c[0] <= fastest * (1 + TIE)]
    return min(near, key=lambda c: c[1])[2]


def interpret_on(platform: str | None) -> bool:
    """The Megablox kernel is Mosaic (TPU) code: on any other platform it runs in Pallas
    interpret mode. ``platform`` is the one the program is compiled for (the runner's
    devices: ``aot_report`` compiles for compile-only TPU devices while JAX's default backend
    stays the CPU); None: JAX's default backend."""
    return (platform or jax.default_backend()).lower() != "tpu"


def grouped_matmul(lhs: jax.Array, w: jax.Array, group_sizes: jax.Array, rows: int,
                   interpret: bool, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """[M_pad, K] rows sorted by group x [G, K, N] -> [M_pad, N] in ``out_dtype`` (accumulated
    in float32 whatever it is); ``rows`` the unpadded M the tiling is chosen for, its tm at
    most ``M_pad``'s own row tile (:func:`row_tile`). Rows past ``sum(group_sizes)`` are
    unspecified."""
    groups, k, n = w.shape
    tm, tk, tn = gmm_tiling(rows, k, n, groups, w.dtype.itemsize)
    tiling = (min(tm, lhs.shape[0] & -lhs.shape[0]), tk, tn)  # powers of two times 16
    if lhs.shape[0] % tiling[0]:
        raise ValueError(f"{lhs.shape[0]} rows are not a multiple of tm={tiling[0]}")
    transpose = k_minor(k, n)
    rhs = w.swapaxes(1, 2) if transpose else w  # a bitcast of the K-minor layout: no copy
    # Traced with shard_map's check_vma off, its output then marked varying (manual_axes.py).
    with jax_config._check_vma(False):
        out = megablox_gmm(lhs, rhs, group_sizes, preferred_element_type=out_dtype,
                           tiling=tiling, transpose_rhs=transpose, interpret=interpret)
    return mark_varying(out, lhs, rhs, group_sizes)


def k_minor(k: int, n: int) -> bool:
    """Whether XLA:TPU lays a ``[G, K, N]`` weight out K-minor (``{1,2,0}``): when N is not a
    multiple of 128 and K is (measured on compile-only v6e: ``bf16[128,2048,192]`` parameters
    get ``{1,2,0}``, which avoids padding 192 lanes to 256). The Mosaic kernel reads its RHS
    row-major, so such a weight must be passed as ``[G, N, K]`` with ``transpose_rhs``;
    otherwise XLA inserts a relayout copy of the whole weight array before every call (it does
    so for ``ragged_dot`` too: ``benchmarks/bench_gmm_tiles.py``)."""
    return n % LANE != 0 and k % LANE == 0


def row_tile(rows: int, w_gate: jax.Array, w_down: jax.Array) -> int:
    """The row padding all three calls share: the largest tm of the three tilings (every tm
    is a power of two times 16, so it is a multiple of the others), halved while it would
    pad ``rows`` by more than an eighth (an EP pass window of 160 decode rows would
    otherwise be 192: XLA's static estimates count the padded rows)."""
    _, hidden, inter = w_gate.shape
    groups, item = w_gate.shape[0], w_gate.dtype.itemsize
    tm = max(gmm_tiling(rows, hidden, inter, groups, item)[0],
             gmm_tiling(rows, inter, hidden, groups, w_down.dtype.itemsize)[0])
    while tm > ROW_TILES[-1] and pad_rows(rows, tm) - rows > rows // 8:
        tm //= 2
    return tm


def take_tiled(a: jax.Array, indices: jax.Array) -> jax.Array:
    """``a[indices]`` of a [N, D] array, as ``[*indices.shape, D / 128, 128]`` when D is a
    multiple of 128 (else ``[*indices.shape, D]``): gathered as whole (8, 128) tiles.

    XLA:TPU tiles the two minor dimensions; a gather of single rows of a [N, D] array moves a
    tile of 8 (16 for bfloat16) rows per row fetched (the compile-only v6e estimates ~10x the
    row bytes). Viewed as [N, D / 128, 128], one row is whole tiles (``benchmarks/
    bench_gmm_tiles.py``: about half the estimated bytes). Indices are in bounds by
    construction ("clip": no out-of-bounds mask).
    """
    n, d = a.shape
    view = a.reshape(n, d // LANE, LANE) if d % LANE == 0 else a
    return jnp.take(view, indices, axis=0, mode="clip")


def take_rows(a: jax.Array, indices: jax.Array) -> jax.Array:
    """``a[indices]`` for a [N, D] array and [M] indices -> [M, D] (:func:`take_tiled`)."""
    return take_tiled(a, indices).reshape(indices.shape[0], a.shape[1])


def pass_rows(assignments: int, shards: int, capacity_factor: float) -> int:
    """Rows of one pass of :func:`gmm_experts` before the padding to the row tile: all
    ``assignments`` on a device that holds every expert (``shards`` = 1), else
    ``capacity_factor`` times the device's even share (``assignments / shards``), at most all
    of them."""
    if shards <= 1:
        return assignments
    return min(assignments, max(1, -(-int(assignments * capacity_factor) // shards)))


def gmm_experts(
    x: jax.Array,
    local_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    platform: str | None = None,
    shards: int = 1,
    capacity_factor: float = CAPACITY_FACTOR,
    out_dtype: jnp.dtype = jnp.float32,
    words: jax.Array | None = None,
    vmem_limit: int = vmem_rows.VMEM_LIMIT,
    activation: ExpertActivation = SILU,
) -> jax.Array:
    """The backend entry point (signature: ``experts.ExpertCompute``) -> [T, H] in
    ``out_dtype`` (the float32 sums rounded once per pass, by the combine kernel itself).
    ``words``: x as gate/up's row DMAs read it (``gmm_gate_up.fetch_source``), if the caller
    has it (packed before an all-gather: ``MoEBackend.gather_tokens``). ``vmem_limit``: the
    scoped VMEM the combine kernel may ask for on the chip (``vmem_rows.vmem_limit``).

    x [T, H]; local_ids / topk_weights [T, k] (rows of this device's stacked weights, or
    ``E_l`` for experts held elsewhere); w_gate, w_up [E_l, H, I]; w_down [E_l, I, H].
    ``platform``: what the program is compiled for (:func:`interpret_on`). ``shards``: how
    many devices the experts are split over (the "expert" axis); with more than one, the
    device's assignments are computed in passes of :func:`pass_rows` rows (module docstring,
    "Passes"). ``activation``: other than silu (gpt-oss's clamped SwiGLU), gate and up are
    two plain grouped matmuls and the activation runs in XLA (the fused kernels compute
    silu).
    """
    interpret = interpret_on(platform)
    num_tokens, top_k = local_ids.shape
    num_rows = w_gate.shape[0]
    order, sorted_weight, inverse, group_sizes = sorted_assignments(local_ids, topk_weights,
                                                                    num_rows)
    m = order.shape[0]
    rows = pass_rows(m, shards, capacity_factor)
    rows_pad = pad_rows(rows, row_tile(rows, w_gate, w_down))
    inverse = inverse.reshape(num_tokens, top_k)  # [T, k]: sorted position of each assignment
    held = local_ids < num_rows
    # Sorted assignments, padded so that any window [start, start + rows_pad) with start < m
    # is in bounds (a dynamic slice past the end would be clamped: a shifted window).
    tail = rows_pad if rows < m else rows_pad - m
    token = jnp.pad(order // top_k, (0, tail))
    weight = jnp.pad(sorted_weight, (0, tail))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    # Rows fetched by DMA (prefill): x packed for the DMAs once, not once per pass.
    fetching = gmm_gate_up.token_mode(num_tokens, x.shape[1], w_gate.shape[2], x.dtype,
                                      rows_pad, row_tile(rows, w_gate, w_down))
    if fetching != gmm_gate_up.FETCH:
        words = None
    elif words is None:
        words = gmm_gate_up.fetch_source(x)

    def one_pass(start: jax.Array | int, init: jax.Array | None = None,
                 sums_dtype: jnp.dtype = jnp.float32,
                 reads_init: jax.Array | bool = True) -> jax.Array:
        """[T, H] in ``sums_dtype``: ``init`` (zeros unless ``reads_init``) plus the
        assignments at sorted positions [start, start + rows_pad)."""
        if rows < m:
            sizes = jnp.clip(jnp.minimum(ends, start + rows_pad) - jnp.maximum(starts, start),
                             0).astype(jnp.int32)
            row_in_window = inverse - start
            in_window = held & (row_in_window >= 0) & (row_in_window < rows_pad)
        else:
            sizes, row_in_window, in_window = group_sizes, inverse, held
        window = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=start,
                                   slice_size=rows_pad)
        return _expert_rows(x, window(token), window(weight), sizes, rows, row_in_window,
                            in_window, w_gate, w_up, w_down, interpret, init, words,
                            sums_dtype, vmem_limit, reads_init, activation)

    if rows >= m:  # one pass holds every assignment
        return one_pass(0, sums_dtype=out_dtype)
    # Data: 1 while no device gets capacity_factor x its share. At least 1: the first pass
    # writes the sums (zeros on a device with no assignment), the carry is never read.
    passes = jnp.maximum(-(-ends[-1] // rows_pad), 1)
    operands = (x, local_ids, topk_weights, w_gate, w_up, w_down)

    def step(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        p, out = carry
        return p + 1, mark_varying(one_pass(p * rows_pad, out, out_dtype, p > 0), *operands)

    # The first pass never reads the carried sums: allocated, not initialised (on TPU).
    # [T, H] by the down weights: x may be wider (gpt-oss's [x, 1] carries the gate/up bias).
    unset = mark_varying(jax.lax.empty((num_tokens, w_down.shape[2]), out_dtype), *operands)
    return jax.lax.while_loop(lambda c: c[0] < passes, step, (jnp.int32(0), unset))[1]


def _expert_rows(x: jax.Array, token: jax.Array, weight: jax.Array, group_sizes: jax.Array,
                 rows: int, index: jax.Array, held: jax.Array, w_gate: jax.Array,
                 w_up: jax.Array, w_down: jax.Array, interpret: bool,
                 init: jax.Array | None = None, words: jax.Array | None = None,
                 sums_dtype: jnp.dtype = jnp.float32,
                 vmem_limit: int = vmem_rows.VMEM_LIMIT,
                 reads_init: jax.Array | bool = True,
                 activation: ExpertActivation = SILU) -> jax.Array:
    """[T, H] in ``sums_dtype``: ``init`` (or zeros; zeros unless ``reads_init``: its
    content is then unspecified) plus the three grouped matmuls over
    ``M_pad`` sorted assignments (token row ``token``, routing weight ``weight``, groups
    ``group_sizes`` from row 0; rows past their sum are in no group: never stored into a
    result, whatever they hold), summed per token: by down's kernel itself
    (``gmm_combine``) where the float32 sums fit VMEM, else through ``index`` [T, k] (the
    assignment's row) where ``held``. Gate and up take the token rows from x themselves
    (``gmm_gate_up.token_mode``; ``words``: x as their DMAs read it), else gathered
    (:func:`_sorted_rows`). The routing weights are applied by the combine kernel as it adds
    the rows (float32 scalars in SMEM, ``gmm_combine.weighs_rows``), else to the activation
    (a ``[M_pad, 1]`` float32 column read by gate/up, 128 lanes wide in HBM)."""
    m_pad = token.shape[0]
    num_tokens, hidden = x.shape
    tm = row_tile(rows, w_gate, w_down)  # M_pad's own tile: the fewest weight blocks
    inter, item = w_gate.shape[2], x.dtype.itemsize
    minor = k_minor(hidden, inter)
    sums_item = jnp.dtype(sums_dtype).itemsize
    combines = gmm_combine.fits(num_tokens, hidden, m_pad, tm, inter, item, sums_item,
                                vmem_limit)
    combine_weighs = combines and gmm_combine.weighs_rows(m_pad)
    act_weight = None if combine_weighs else weight
    fused = activation == SILU  # the gate/up kernel computes silu(gate) * up itself
    if fused and gmm_gate_up.token_mode(num_tokens, hidden, inter, x.dtype, m_pad,
                                        tm) is not None:
        # The kernel takes the rows from x itself (held in VMEM at decode, by row DMAs at
        # prefill): the sorted [M_pad, H] rows are never written.
        act = gmm_gate_up.gate_up_act(x, token, w_gate, w_up, act_weight, group_sizes, tm,
                                      minor, interpret, words)
    elif fused and gmm_gate_up.column_tile(tm, hidden, inter, item) is not None:
        act = gmm_gate_up.gate_up_act(_sorted_rows(x, token, interpret), None, w_gate, w_up,
                                      act_weight, group_sizes, tm, minor, interpret)
    else:
        xs = _sorted_rows(x, token, interpret)
        gate = grouped_matmul(xs, w_gate, group_sizes, rows, interpret)
        up = grouped_matmul(xs, w_up, group_sizes, rows, interpret)
        act = activation(gate, up)
        act = (act if act_weight is None else act * act_weight[:, None]).astype(x.dtype)
    if combines:
        return gmm_combine.down_and_combine(
            act, w_down, group_sizes, token, init, num_tokens, tm, interpret,
            weight if combine_weighs else None, sums_dtype, vmem_limit, reads_init)
    down = grouped_matmul(act, w_down, group_sizes, rows, interpret, x.dtype)  # [M_pad, H]
    out = sum_token_rows(down, jnp.clip(index, 0, m_pad - 1), held)
    if init is not None:  # a select, not a multiply: an unread init may hold NaN
        out = jnp.where(reads_init, init + out, out)
    return out.astype(sums_dtype)


def _sorted_rows(x: jax.Array, token: jax.Array, interpret: bool) -> jax.Array:
    """``[M_pad, H]``: the token row of each sorted assignment, by the VMEM kernel (x read
    once) when a column block of x fits, else by XLA's gather of whole tiles."""
    if vmem_rows.fits(x.shape[0], x.shape[1], x.dtype.itemsize, token.shape[0]):
        return vmem_rows.gather_rows(x, token, token.shape[0], interpret)
    return take_rows(x, token)


def sum_token_rows(rows: jax.Array, index: jax.Array, held: jax.Array) -> jax.Array:
    """float32 [T, H]: for each token, the sum of the rows ``rows[index[t, j]]`` ([M, H],
    compute dtype) of its assignments ``j`` that ``held`` ([T, k]); the others are dropped
    with a select, not a multiply (their rows are unspecified, maybe NaN).

    Gathered and summed in whole tiles (:func:`take_tiled`: [T, k, H / 128, 128]) so that
    only the [T, H] result is re-laid out, not the [T, k, H] rows; the cast to float32
    inside the reduction, so XLA fuses it rather than writing a float32 copy of the rows
    (compile-only v6e, one layer at 8,192 prefill tokens: 5.7 -> 4.8 GB)."""
    picked = take_tiled(rows, index)  # [T, k, ...]
    mask = held.reshape(held.shape + (1,) * (picked.ndim - 2))
    kept = jnp.where(mask, picked, jnp.zeros((), picked.dtype))
    return jnp.sum(kept, axis=1, dtype=jnp.float32).reshape(index.shape[0], rows.shape[1])


@dataclass(frozen=True)
class GmmExperts:
    """``gmm_experts`` for one platform (an ``experts.ExpertCompute``): hashable and equal by
    value, as a static of the compiled step must be."""

    platform: str | None = None
    shards: int = 1  # devices the experts are split over (``ep_moe`` sets it)
    capacity_factor: float = CAPACITY_FACTOR
    vmem_limit: int = vmem_rows.VMEM_LIMIT  # of the chip (``vmem_rows.vmem_limit``)
    activation: ExpertActivation = SILU

    def __call__(self, x: jax.Array, local_ids: jax.Array, topk_weights: jax.Array,
                 w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                 out_dtype: jnp.dtype = jnp.float32, words: jax.Array | None = None,
                 ) -> jax.Array:
        return gmm_experts(x, local_ids, topk_weights, w_gate, w_up, w_down, self.platform,
                           self.shards, self.capacity_factor, out_dtype, words,
                           self.vmem_limit, self.activation)
