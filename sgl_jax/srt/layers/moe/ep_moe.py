"""Expert-parallel MoE over the mesh axes ("expert", "tensor"): one forward for every
placement.

Placement (``placement.py``). A layer's experts are stacked into ``[P, ...]`` weights whose
leading axis is split over the "expert" mesh axis: device ``d`` of that axis holds rows
``[d * P_l, (d + 1) * P_l)``, ``P_l = P / ep_size``. The loader stacks them in the layer's
physical order (its ``ExpertPlacement.physical_order``), so device d's shard holds exactly
the experts of its row of the placement. A static placement (``P = E``, contiguous by
default, any permutation with ``--ep-expert-mapping``) is recorded on the MoE block as the
compile-time tuple ``expert_order`` (:func:`apply_placement`): a new one means new weights
and a new compilation. A dynamic one (EPLB, ``P = E + R``) is data: the block's
``ExpertLocation`` arrays ``replicas`` / ``num_replicas``, swapped by a rebalance without a
recompilation.

Forward (:func:`ep_moe_forward`). The router runs once, replicated, and its top-k ids are the
LOGICAL ids (the routed-experts capture sees them before any placement). Each assignment is
turned into a physical row, by the inverse of the static order (:func:`static_physical_ids`;
nothing at all for the default identity order) or by choosing one of the expert's replicas
(:func:`physical_ids`). Inside ``shard_map`` every device turns the rows it holds into local
rows by a subtraction (the sentinel ``P_l`` for rows held elsewhere), runs the expert backend
(``experts.py``: ``dense`` or ``ragged``) on its own experts (with tp > 1: its slice of their
intermediate dimension), and one ``psum`` over ("expert", "tensor") adds the float32 partial
outputs. No device ever holds another device's expert weights, and x is never moved: the only
communication is that all-reduce of a ``[T, H]`` array (``docs/moe_backends.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.moe.dispatch import RaggedAllToAll, all_to_all_experts
from sgl_jax.srt.layers.moe.experts import MoEBackend
from sgl_jax.srt.layers.moe.placement import ExpertPlacement

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
EXPERT_ORDER = "expert_order"  # attribute of a MoE block: its physical order (static tuple)

# Partition specs of a MoE block's stacked weights (shared with the model's parameter specs).
W_GATE_UP_SPEC = (EXPERT_AXIS, None, TENSOR_AXIS)  # [E, H, I]
W_DOWN_SPEC = (EXPERT_AXIS, TENSOR_AXIS, None)  # [E, I, H]


class ExpertLocation(nnx.Variable):
    """EPLB placement arrays of a MoE block (not parameters, not in a checkpoint): traced
    like the weights, so a rebalance swaps them without a recompilation."""


def layer_of(path: Sequence[str | int]) -> int:
    """The decoder layer of a parameter path like ``("model", "layers", 3, "mlp", "w_up")``."""
    return next(int(p) for p in path if isinstance(p, int))


def apply_placement(model: nnx.Module, placement: ExpertPlacement) -> None:
    """Records each MoE block's physical order (static placements). The loader calls it with
    the placement it stacked the experts by: the two must agree, or experts get other experts'
    weights."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, EXPERT_ORDER):
            order = placement.physical_order(module.layer_id)
            setattr(module, EXPERT_ORDER, tuple(int(e) for e in order))


def static_physical_ids(topk_ids: jax.Array, expert_order: Sequence[int],
                        one_hot: bool = False) -> jax.Array:
    """Static placement: LOGICAL ids ``[T, k]`` -> rows of the stacked weights, through the
    inverse of the compile-time order (the identity order, the default: the ids themselves).
    ``one_hot``: looked up by :func:`lookup_rows` (compiled for TPU), else by a gather."""
    order = np.asarray(expert_order, dtype=np.int32)
    if np.array_equal(order, np.arange(order.size)):
        return topk_ids
    inverse = jnp.asarray(np.argsort(order).astype(np.int32))
    return lookup_rows(inverse[:, None], topk_ids)[..., 0] if one_hot else inverse[topk_ids]


def physical_ids(topk_ids: jax.Array, replicas: jax.Array, num_replicas: jax.Array,
                 one_hot: bool = False) -> jax.Array:
    """EPLB: LOGICAL ids ``[T, k]`` -> physical rows ``[T, k]``. Assignment (t, j) of expert e
    takes replica ``(t + j) % num_replicas[e]`` (token index in the padded batch: an expert's
    tokens split evenly and deterministically over its replicas; ``eplb.replica_choice`` is
    the numpy twin). ``one_hot``: both lookups by :func:`lookup_rows` (compiled for TPU),
    else by gathers."""
    num_tokens, top_k = topk_ids.shape
    index = (jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
             + jnp.arange(top_k, dtype=jnp.int32)[None, :])
    if not one_hot:
        return replicas[topk_ids, index % jnp.take(num_replicas, topk_ids)]
    looked = lookup_rows(jnp.concatenate([num_replicas[:, None], replicas], axis=1), topk_ids)
    choice = index % jnp.maximum(looked[..., 0], 1)  # every expert has a replica
    picked = choice[..., None] == jnp.arange(replicas.shape[1], dtype=jnp.int32)
    return jnp.sum(jnp.where(picked, looked[..., 1:], 0), axis=-1, dtype=jnp.int32)


def lookup_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` for a small int32 ``table [N, C]`` of values in ``[0, 65536)`` (replica
    counts, physical rows): ``ids [...]`` -> ``[..., C]``, by a one-hot matmul.

    For programs compiled for TPU, where XLA counts each element of a gather from such a
    table at a whole tile of it. Every MoE layer looks up its ``T * k`` assignments: at
    ``T * k = 65,536``, compiled alone for v5p, a 128-entry static order's gather is 4.3 GB
    and EPLB's two are 8.7 GB; these lookups 2.1 and 37.5 MB (docs/performance.md). On CPU
    the gather is the cheaper (0.3 against 7.7 ms for EPLB's at that size). The ids' one-hot
    rows (bfloat16) multiply the table split into its low and high bytes (integers below
    256, exact in bfloat16); each output is one product of 1 and a byte, summed in float32
    with zeros: exact. An id outside ``[0, N)`` gives 0 (a gather would clamp it): the ids
    are the router's."""
    size, columns = table.shape
    table = table.astype(jnp.int32)
    halves = jnp.concatenate([table % 256, table // 256], axis=1).astype(jnp.bfloat16)
    one_hot = (ids[..., None] == jnp.arange(size, dtype=ids.dtype)).astype(jnp.bfloat16)
    got = jnp.einsum("...n,nc->...c", one_hot, halves,
                     preferred_element_type=jnp.float32).astype(jnp.int32)
    return got[..., :columns] + 256 * got[..., columns:]


def _local_rows(rows: jax.Array, rows_here: int) -> jax.Array:
    """Inside ``shard_map``: the device's local row of each physical row it holds, the
    sentinel ``rows_here`` for the others. Physical rows are contiguous per device, so a row
    becomes a local one by a subtraction; rows held elsewhere contribute nothing here, so the
    partial sums of all devices add up to the single-device result. With one device on the
    expert axis every row is its own (the ``[T, k]`` select would be a no-op pass)."""
    if jax.lax.axis_size(EXPERT_AXIS) == 1:
        return rows
    local = rows - jax.lax.axis_index(EXPERT_AXIS) * rows_here
    return jnp.where((local >= 0) & (local < rows_here), local, rows_here)


def scatter_token_sums(sums: jax.Array, axis: str) -> jax.Array:
    """``jax.lax.psum_scatter`` of ``[T, H]`` sums over ``axis`` by token blocks (tiled: the
    device at index i gets rows ``[i * T / n, (i + 1) * T / n)``), the blocks a leading
    dimension of their own. The same result; XLA:TPU lowers a scatter of the first dimension
    of a 2-D array as an uneven ring (each device's output over-sized, then a
    collective-permute, a concatenate and a slice to fix it up): on v5p:2x2x4, with the
    235B's ``[8,192, 4,096]`` bf16 sums scattered over "expert" and then "tensor", XLA
    counts 238 MB that way and 152 MB this way (``docs/performance.md``)."""
    n = jax.lax.axis_size(axis)
    tokens, hidden = sums.shape
    blocks = sums.reshape(n, tokens // n, hidden)
    return jax.lax.psum_scatter(blocks, axis, scatter_dimension=0, tiled=True).reshape(
        tokens // n, hidden)


def ep_moe_forward(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    expert_order: Sequence[int],
    backend: MoEBackend,
    location: tuple[jax.Array, jax.Array] | None = None,
    tokens_split: bool = False,
    all_to_all: RaggedAllToAll | None = None,
    sequence_split: bool = False,
    one_hot_lookups: bool = False,
) -> jax.Array:
    """x [T, H] (replicated; split by token under ``sequence_split``); topk_ids /
    topk_weights [T, k] LOGICAL ids and their weights; stacked weights ``[P, ...]`` in
    physical order; ``backend`` the expert compute chosen at start-up
    (``experts.create_moe_backend``). Returns [T, H] in x's dtype.

    The placement says which physical row serves each assignment: ``location`` (a dynamic
    placement: ``(replicas [E, R + 1], num_replicas [E])`` device arrays, ``expert_order``
    unused) or, without it, the static ``expert_order`` [E] (a compile-time constant).
    ``one_hot_lookups`` (compiled for TPU): their lookups by one-hot matmuls, not gathers.

    Traced under ``jax.set_mesh(mesh)`` (the model runner's step), this is an explicit
    ``shard_map`` over the mesh; without a mesh in context (a model called directly) the same
    maths runs on the whole stacked weights.

    ``tokens_split`` (DP attention): x and the routing are split by token over "expert" (each
    attention rank holds its own tokens). Each device all-gathers the tokens of the other
    ranks, runs its experts on all of them, and a reduce-scatter over "expert" hands every
    rank the sums for its own tokens (then the "tensor" partial sums are added). Dropless and
    exact: the same assignments reach the same experts as without DP. With ``all_to_all``
    (the ragged all-to-all collective to use) each device receives only the assignments to
    its own experts instead (``dispatch.all_to_all_experts``).

    ``sequence_split`` (``models/sequence_parallel.py``): x arrives split by token over
    "tensor" (with ``tokens_split``: over "expert" x "tensor", each rank's tokens split over
    its devices; not with ``all_to_all``) and is all-gathered inside (for gmm, packed for
    its row DMAs before the gather: ``MoEBackend.gather_tokens``); the result is returned
    split the same way, the partial sums of the "tensor" axis reduce-scattered instead of
    all-reduced.
    """
    if sequence_split and all_to_all is not None:
        raise ValueError("ep_moe_forward: the all-to-all dispatch takes each rank's tokens "
                         "whole (sequence_split=False)")
    if location is None:
        rows = static_physical_ids(topk_ids, expert_order, one_hot_lookups)
    else:
        rows = physical_ids(topk_ids, *location, one_hot=one_hot_lookups)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {EXPERT_AXIS, TENSOR_AXIS} <= set(mesh.axis_names):
        return backend(x, rows, topk_weights, w_gate, w_up, w_down).astype(x.dtype)
    backend = backend.sharded(mesh.shape[EXPERT_AXIS])
    # The routing crosses the shard_map boundary (and its all-gathers) flat, [T * k]: XLA:TPU
    # lays a [T, k] int32 or float32 array out 128 lanes wide, 16 times its bytes at k = 8,
    # and the backends flatten it anyway.
    top_k = topk_ids.shape[1]

    def routing(rows: jax.Array, topk_weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        return rows.reshape(-1, top_k), topk_weights.reshape(-1, top_k)

    def local_experts(x: jax.Array, rows: jax.Array, topk_weights: jax.Array,
                      w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        if sequence_split:
            # x and the routing arrive split by token over "tensor": every device's tokens
            # gathered (for gmm, x packed for its row DMAs before the gather). The sums are
            # scattered over "tensor" first, so the "expert" sum moves T / tp rows; in the
            # activation dtype, as XLA:TPU already moves the cast before the replicated
            # layout's all-reduce (a bf16 all-reduce of the combine's float32 sums).
            rows, topk_weights = (jax.lax.all_gather(a, TENSOR_AXIS, axis=0, tiled=True)
                                  for a in (rows, topk_weights))
            x, words = backend.gather_tokens(x, TENSOR_AXIS)
            rows, topk_weights = routing(rows, topk_weights)
            local = _local_rows(rows, w_gate.shape[0])
            partial = backend(x, local, topk_weights, w_gate, w_up, w_down, x.dtype, words)
            return jax.lax.psum(scatter_token_sums(partial, TENSOR_AXIS), EXPERT_AXIS)
        rows, topk_weights = routing(rows, topk_weights)
        local = _local_rows(rows, w_gate.shape[0])
        partial = backend(x, local, topk_weights, w_gate, w_up, w_down)  # float32
        return jax.lax.psum(partial, (EXPERT_AXIS, TENSOR_AXIS)).astype(x.dtype)

    def dispatched_experts(x: jax.Array, rows: jax.Array, topk_weights: jax.Array,
                           w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        # All-gather the ranks' tokens (every device needs every assignment to its experts),
        # compute this device's share, and reduce-scatter the sums back to their ranks. Under
        # sequence parallelism each device holds 1/tp of its rank's tokens: gathered over
        # both axes, and the rank's sums scattered over "tensor" too instead of all-reduced.
        axes = (EXPERT_AXIS, TENSOR_AXIS) if sequence_split else EXPERT_AXIS
        rows, topk_weights = routing(*(jax.lax.all_gather(a, axes, axis=0, tiled=True)
                                       for a in (rows, topk_weights)))
        x, words = backend.gather_tokens(x, axes)  # gmm's packed rows too
        local = _local_rows(rows, w_gate.shape[0])
        # In the activation dtype, as XLA:TPU already moves the cast before the psum without
        # DP: half the bytes over the links in bfloat16 (float32 on CPU: nothing changes).
        partial = backend(x, local, topk_weights, w_gate, w_up, w_down, x.dtype, words)
        mine = scatter_token_sums(partial, EXPERT_AXIS)
        if sequence_split:
            return scatter_token_sums(mine, TENSOR_AXIS)
        return jax.lax.psum(mine, TENSOR_AXIS)

    tokens = P(EXPERT_AXIS) if tokens_split else P()
    if sequence_split:  # x and the routing split by token, gathered inside
        tokens = P((EXPERT_AXIS, TENSOR_AXIS)) if tokens_split else P(TENSOR_AXIS)
    if not tokens_split:
        per_device = local_experts
    elif all_to_all is None:
        per_device = dispatched_experts
    else:
        def per_device(x: jax.Array, rows: jax.Array, topk_weights: jax.Array,
                       *weights: jax.Array) -> jax.Array:
            return all_to_all_experts(backend, all_to_all, x, *routing(rows, topk_weights),
                                      *weights)
    moe = jax.shard_map(
        per_device, mesh=mesh,
        in_specs=(tokens, tokens, tokens, P(*W_GATE_UP_SPEC), P(*W_GATE_UP_SPEC),
                  P(*W_DOWN_SPEC)),
        out_specs=tokens,
    )
    return moe(x, rows.reshape(-1), topk_weights.reshape(-1), w_gate, w_up, w_down)
