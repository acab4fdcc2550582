"""Expert-parallel MoE over the mesh axes ("expert", "tensor"), driven by a device-expert mapping.

Placement. A layer's experts are stacked into ``[E, ...]`` weights whose leading axis is split
over the "expert" mesh axis: device ``d`` of that axis holds rows ``[d * E_l, (d + 1) * E_l)``,
``E_l = E / ep_size``. The mapping says which logical experts those rows are::

    global_expert_id = mapping[d][local_expert_id]      (mapping: [ep_size, E_l])

so the stacked weight is the checkpoint's experts in the order ``mapping.reshape(-1)``, the
layer's "physical order": the loader reads the experts in that order (device d's shard then
holds exactly mapping[d]) and records it on the MoE block as the static tuple
``expert_order`` (:func:`apply_expert_mapping`). The default mapping is contiguous (device d
holds experts ``d*E_l .. d*E_l+E_l-1``: the identity order); any permutation may be given, per
layer, e.g. one balanced from routed-expert statistics (:func:`balanced_mapping`). The order
is a compile-time constant: a new mapping means new weights and a new compilation.

Forward (:func:`ep_moe_forward`). The router runs once, replicated, and its top-k ids are the
LOGICAL ids (the routed-experts capture sees them before any mapping). Inside ``shard_map``
every device translates them, through its row of the mapping (:func:`local_row_table`), into
rows of its own shard of the weights (the sentinel ``E_l`` for experts held elsewhere), runs the
expert backend (``experts.py``: ``dense`` or ``ragged``) on its own experts (with tp > 1: its
slice of their intermediate dimension), and one ``psum`` over ("expert", "tensor") adds the
float32 partial outputs. No device ever holds another device's expert weights, and x is never
moved: the only communication is that all-reduce of a ``[T, H]`` array (``docs/moe_backends.md``).

EPLB (``--enable-eplb``, ``eplb.py``): the weights have ``P = E + R`` physical rows and the
placement is DATA (``ExpertLocation`` arrays ``replicas`` / ``num_replicas`` passed with the
weights), so a rebalance needs no recompilation; each logical id is turned into one of its
replicas (:func:`physical_ids`) and, per device, into a local row by a subtraction. Without it
the static path above is unchanged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.layers.moe.experts import get_expert_compute

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
EXPERT_ORDER = "expert_order"  # attribute of a MoE block: its physical order (static tuple)

# Partition specs of a MoE block's stacked weights (shared with the model's parameter specs).
W_GATE_UP_SPEC = (EXPERT_AXIS, None, TENSOR_AXIS)  # [E, H, I]
W_DOWN_SPEC = (EXPERT_AXIS, TENSOR_AXIS, None)  # [E, I, H]


class ExpertLocation(nnx.Variable):
    """EPLB placement arrays of a MoE block (not parameters, not in a checkpoint): traced
    like the weights, so a rebalance swaps them without a recompilation."""


class ExpertMapping:
    """Per-layer device-expert mapping tables ``[ep_size, E / ep_size]`` of logical expert ids.

    Invariant: every table is a permutation of ``range(num_experts)`` split into ``ep_size``
    equal rows. Layers without a table of their own use ``default``.
    """

    def __init__(
        self, default: np.ndarray | Sequence[Sequence[int]],
        per_layer: Mapping[int, np.ndarray | Sequence[Sequence[int]]] | None = None,
    ) -> None:
        self.default = _check_table(default, "the mapping")
        self.ep_size, self.experts_per_device = self.default.shape
        self.num_experts = self.default.size
        self.per_layer: dict[int, np.ndarray] = {}
        for layer, table in (per_layer or {}).items():
            checked = _check_table(table, f"the mapping of layer {layer}")
            if checked.shape != self.default.shape:
                raise ValueError(
                    f"the mapping of layer {layer} has shape {checked.shape}; the others have "
                    f"{self.default.shape} ([ep_size, num_experts / ep_size])"
                )
            self.per_layer[int(layer)] = checked

    @staticmethod
    def contiguous(num_experts: int, ep_size: int) -> ExpertMapping:
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}")
        return ExpertMapping(np.arange(num_experts, dtype=np.int32).reshape(ep_size, -1))

    @staticmethod
    def parse(spec: str | Sequence[Any] | Mapping[str, Any]) -> ExpertMapping:
        """From ``--ep-expert-mapping``: inline JSON or a JSON file holding either one table
        ``[[...], ...]`` for every layer, or ``{"default": table, "<layer_id>": table, ...}``
        (``default`` optional: contiguous)."""
        obj: Any = spec
        if isinstance(spec, str):
            text = spec.strip()
            if not text.startswith(("[", "{")):
                if not os.path.isfile(text):
                    raise ValueError(f"expert mapping {spec!r} is neither JSON nor a file")
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"expert mapping is not valid JSON: {e}") from e
        if isinstance(obj, Mapping):
            layers = {int(k): v for k, v in obj.items() if k != "default"}
            if "default" in obj:
                return ExpertMapping(obj["default"], layers)
            if not layers:
                raise ValueError("expert mapping {} has no table")
            first = _check_table(next(iter(layers.values())), "the mapping")
            return ExpertMapping(np.arange(first.size, dtype=np.int32).reshape(first.shape), layers)
        return ExpertMapping(obj)

    def to_json(self) -> str:
        obj: dict[str, Any] = {"default": self.default.tolist()}
        obj.update({str(k): v.tolist() for k, v in sorted(self.per_layer.items())})
        return json.dumps(obj)

    def check(self, num_experts: int, ep_size: int) -> None:
        if (self.num_experts, self.ep_size) != (num_experts, ep_size):
            raise ValueError(
                f"the expert mapping places {self.num_experts} experts on {self.ep_size} "
                f"device(s); the model has num_experts={num_experts} and ep_size={ep_size}"
            )

    def for_layer(self, layer_id: int) -> np.ndarray:
        """``[ep_size, E_l]``: ``table[d][j]`` is the logical id of device d's local expert j."""
        return self.per_layer.get(layer_id, self.default)

    def physical_order(self, layer_id: int) -> np.ndarray:
        """``[E]`` int32: the logical expert stored at each row of the stacked weights."""
        return self.for_layer(layer_id).reshape(-1)

    def device_of(self, layer_id: int) -> np.ndarray:
        """``[E]``: the expert-axis device holding each logical expert."""
        table = self.for_layer(layer_id)
        owner = np.empty(self.num_experts, np.int32)
        owner[table.reshape(-1)] = np.repeat(np.arange(self.ep_size), self.experts_per_device)
        return owner


def _check_table(table: np.ndarray | Sequence[Sequence[int]], what: str) -> np.ndarray:
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what} must be a non-empty 2-D integer array [ep_size, num_experts / ep_size] "
            f"(row d: the experts of device d); got shape {arr.shape}, dtype {arr.dtype}"
        )
    flat = arr.reshape(-1)
    if not np.array_equal(np.sort(flat), np.arange(flat.size)):
        dup = sorted({int(e) for e in flat if np.count_nonzero(flat == e) > 1})
        lost = sorted(set(range(flat.size)) - {int(e) for e in flat})
        raise ValueError(
            f"{what} must hold every expert 0..{flat.size - 1} exactly once; "
            f"duplicated {dup[:8]}, missing or out of range {lost[:8]}"
        )
    return arr.astype(np.int32)


def layer_of(path: Sequence[str | int]) -> int:
    """The decoder layer of a parameter path like ``("model", "layers", 3, "mlp", "w_up")``."""
    return next(int(p) for p in path if isinstance(p, int))


def apply_expert_mapping(model: nnx.Module, mapping: ExpertMapping) -> None:
    """Records each MoE block's physical order. The loader calls it with the mapping it
    stacked the experts by: the two must agree, or experts get other experts' weights."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, EXPERT_ORDER):
            order = mapping.physical_order(module.layer_id)
            setattr(module, EXPERT_ORDER, tuple(int(e) for e in order))


def balanced_mapping(expert_load: np.ndarray | Sequence[float], ep_size: int) -> np.ndarray:
    """A ``[ep_size, E / ep_size]`` table that spreads ``expert_load`` (e.g. token counts per
    expert from routed-experts statistics) evenly: greedy, heaviest expert first onto the
    least loaded device that still has room. Rows are sorted by expert id."""
    load = np.asarray(expert_load, dtype=np.float64)
    num_experts = load.size
    if num_experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}")
    per_device = num_experts // ep_size
    totals = np.zeros(ep_size)
    rows: list[list[int]] = [[] for _ in range(ep_size)]
    for e in np.argsort(-load, kind="stable"):
        open_devices = [d for d in range(ep_size) if len(rows[d]) < per_device]
        d = min(open_devices, key=lambda i: (totals[i], i))
        rows[d].append(int(e))
        totals[d] += load[e]
    return np.array([sorted(r) for r in rows], dtype=np.int32)


def expert_load(routed_experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Routed-experts rows ``[..., num_layers, k]`` -> tokens per expert ``[num_layers, E]``
    (rows of -1, layers without a router, count nothing)."""
    ids = np.asarray(routed_experts).reshape(-1, *np.shape(routed_experts)[-2:])
    out = np.zeros((ids.shape[1], num_experts), np.int64)
    for layer in range(ids.shape[1]):
        flat = ids[:, layer].reshape(-1)
        out[layer] = np.bincount(flat[flat >= 0], minlength=num_experts)
    return out


def local_row_table(expert_order: Sequence[int], ep_size: int) -> np.ndarray:
    """``[ep_size, E]`` int32: ``table[d][e]`` is the row of logical expert e in expert-axis
    device d's shard of the stacked weights, or ``E_l = E / ep_size`` (the sentinel: held by
    another device). The inverse of the mapping rows; a compile-time constant."""
    order = np.asarray(expert_order, dtype=np.int32)
    per_device = order.size // ep_size
    table = np.full((ep_size, order.size), per_device, dtype=np.int32)
    for d, experts in enumerate(order.reshape(ep_size, per_device)):
        table[d, experts] = np.arange(per_device, dtype=np.int32)
    return table


def physical_ids(topk_ids: jax.Array, replicas: jax.Array, num_replicas: jax.Array) -> jax.Array:
    """EPLB: LOGICAL ids ``[T, k]`` -> physical rows ``[T, k]``. Assignment (t, j) of expert e
    takes replica ``(t + j) % num_replicas[e]`` (token index in the padded batch: an expert's
    tokens split evenly and deterministically over its replicas; ``eplb.replica_choice`` is
    the numpy twin)."""
    num_tokens, top_k = topk_ids.shape
    index = (jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
             + jnp.arange(top_k, dtype=jnp.int32)[None, :])
    choice = index % jnp.take(num_replicas, topk_ids)
    return replicas[topk_ids, choice]


def _eplb_forward(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array,
                  w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  location: tuple[jax.Array, jax.Array], compute: Any) -> jax.Array:
    """The EPLB path: physical rows are contiguous per device (device d: rows
    ``[d * P_l, (d + 1) * P_l)``), so a physical id becomes a local row by a subtraction."""
    phys = physical_ids(topk_ids, *location)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {EXPERT_AXIS, TENSOR_AXIS} <= set(mesh.axis_names):
        return compute(x, phys, topk_weights, w_gate, w_up, w_down).astype(x.dtype)

    def local_experts(x: jax.Array, phys: jax.Array, topk_weights: jax.Array,
                      w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        per_device = w_gate.shape[0]
        local = phys - jax.lax.axis_index(EXPERT_AXIS) * per_device
        rows = jnp.where((local >= 0) & (local < per_device), local, per_device)
        partial = compute(x, rows, topk_weights, w_gate, w_up, w_down)
        return jax.lax.psum(partial, (EXPERT_AXIS, TENSOR_AXIS)).astype(x.dtype)

    moe = jax.shard_map(
        local_experts, mesh=mesh,
        in_specs=(P(), P(), P(), P(*W_GATE_UP_SPEC), P(*W_GATE_UP_SPEC), P(*W_DOWN_SPEC)),
        out_specs=P(),
    )
    return moe(x, phys, topk_weights, w_gate, w_up, w_down)


def ep_moe_forward(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    expert_order: Sequence[int],
    backend: str = "dense",
    location: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """x [T, H] (replicated); topk_ids / topk_weights [T, k] LOGICAL ids and their weights;
    stacked weights in physical order; expert_order [E] that order; backend a resolved
    expert backend, "dense" or "ragged" (static: part of the compiled program). Returns
    [T, H] in x's dtype.

    Traced under ``jax.set_mesh(mesh)`` (the model runner's step), this is an explicit
    ``shard_map`` over the mesh; without a mesh in context (a model called directly) the same
    maths runs on the whole stacked weights.

    ``location`` (EPLB only): ``(replicas [E, R + 1], num_replicas [E])`` device arrays; the
    weights then have ``P = E + R`` physical rows and ``expert_order`` is not used.
    """
    compute = get_expert_compute(backend)
    if location is not None:
        return _eplb_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, location, compute)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {EXPERT_AXIS, TENSOR_AXIS} <= set(mesh.axis_names):
        rows = jnp.asarray(local_row_table(expert_order, 1)[0])[topk_ids]
        return compute(x, rows, topk_weights, w_gate, w_up, w_down).astype(x.dtype)
    table = local_row_table(expert_order, mesh.shape[EXPERT_AXIS])

    def local_experts(
        x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w_gate: jax.Array,
        w_up: jax.Array, w_down: jax.Array,
    ) -> jax.Array:
        # This device's row of the table is the only place a global id is translated.
        # Assignments to experts held elsewhere get the sentinel row and contribute nothing
        # here, so the partial sums of all devices add up to the single-device result.
        rows = jnp.asarray(table)[jax.lax.axis_index(EXPERT_AXIS)][topk_ids]
        partial = compute(x, rows, topk_weights, w_gate, w_up, w_down)  # float32
        return jax.lax.psum(partial, (EXPERT_AXIS, TENSOR_AXIS)).astype(x.dtype)

    moe = jax.shard_map(
        local_experts,
        mesh=mesh,
        in_specs=(P(), P(), P(), P(*W_GATE_UP_SPEC), P(*W_GATE_UP_SPEC), P(*W_DOWN_SPEC)),
        out_specs=P(),
    )
    return moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)
