"""Where each MoE layer's experts live on the expert axis: one type, :class:`ExpertPlacement`.

A layer's stacked expert weights have ``P`` physical rows split over the ``ep_size`` devices
of the "expert" mesh axis in equal contiguous blocks: device ``d`` holds rows
``[d * P_l, (d + 1) * P_l)``, ``P_l = P / ep_size``. A placement is, per MoE layer, the table
``[ep_size, P_l]`` of the LOGICAL expert whose weights each row holds (row-major: the
layer's ``physical_to_logical [P]``, the order the loader stacks the experts in).

Two kinds, one type:

- **static** (``dynamic=False``; ``--ep-expert-mapping``, default contiguous): ``P = E``, a
  permutation of the experts. The layer's physical order is a compile-time constant of the
  step (the MoE block's ``expert_order``): a new static placement means new weights and a new
  compilation, so it never rebalances.
- **dynamic** (``dynamic=True``; ``--enable-eplb``): ``P = E + R`` with ``R`` redundant rows;
  every expert has at least one row and a hot expert may have several (replicas). The
  placement is data (``replica_tables`` -> the block's ``ExpertLocation`` arrays), so a
  rebalance swaps it without a recompilation (``model_executor/eplb_manager.py``).

The tables the forward and a rebalance need (``replica_tables``, ``source_rows``) and the
numpy twin of the forward's replica choice live here too; the algorithms that choose a
placement from a load are in ``balancing.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sgl_jax.srt.layers.moe.balancing import compute_placement

Table = np.ndarray | Sequence[Sequence[int]]


class ExpertPlacement:
    """Per-layer tables ``[ep_size, P / ep_size]`` of logical expert ids; layers without a
    table of their own use ``default``.

    Invariants: every table has the same shape and holds each expert ``0 .. E-1`` at least
    once; a static placement holds each exactly once (``P = E``).
    """

    def __init__(self, default: Table, per_layer: Mapping[int, Table] | None = None, *,
                 num_experts: int | None = None, dynamic: bool = False) -> None:
        self.dynamic = dynamic
        self.default = _check_table(default, "the placement", num_experts, dynamic)
        self.ep_size, self.rows_per_device = self.default.shape
        self.num_physical = self.default.size
        self.num_experts = num_experts if num_experts is not None else self.num_physical
        self.per_layer: dict[int, np.ndarray] = {}
        for layer, table in (per_layer or {}).items():
            checked = _check_table(table, f"the placement of layer {layer}", self.num_experts,
                                   dynamic)
            if checked.shape != self.default.shape:
                raise ValueError(
                    f"the placement of layer {layer} has shape {checked.shape}; the others "
                    f"have {self.default.shape} ([ep_size, physical experts / ep_size])")
            self.per_layer[int(layer)] = checked

    # -- constructors ------------------------------------------------------------------------
    @staticmethod
    def contiguous(num_experts: int, ep_size: int) -> ExpertPlacement:
        """Static: device d holds experts ``d*E_l .. (d+1)*E_l - 1`` (the identity order)."""
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}")
        return ExpertPlacement(np.arange(num_experts, dtype=np.int32).reshape(ep_size, -1))

    @staticmethod
    def redundant(num_experts: int, num_physical: int, ep_size: int) -> ExpertPlacement:
        """Dynamic, before any load is known: the experts in order, then the redundant rows
        round-robin (0, 1, ...)."""
        if num_physical % ep_size or num_physical < num_experts:
            raise ValueError(
                f"{num_physical} physical experts (num_experts={num_experts} + redundant) must "
                f"be at least num_experts and a multiple of ep_size={ep_size}")
        return ExpertPlacement(default_placement(num_experts, num_physical).reshape(ep_size, -1),
                               num_experts=num_experts, dynamic=True)

    @staticmethod
    def from_layers(tables: Mapping[int, np.ndarray], num_experts: int,
                    ep_size: int) -> ExpertPlacement:
        """Dynamic, from every MoE layer's ``physical_to_logical [P]``."""
        tables = {int(k): np.asarray(v).reshape(ep_size, -1) for k, v in tables.items()}
        first = next(iter(tables.values()))
        return ExpertPlacement(first, tables, num_experts=num_experts, dynamic=True)

    @staticmethod
    def parse(spec: str | Sequence[Any] | Mapping[str, Any]) -> ExpertPlacement:
        """Static, from ``--ep-expert-mapping``: inline JSON or a JSON file holding either one
        table ``[[...], ...]`` for every layer, or ``{"default": table, "<layer_id>": table,
        ...}`` (``default`` optional: contiguous)."""
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
        if not isinstance(obj, Mapping):
            return ExpertPlacement(obj)
        layers = {int(k): v for k, v in obj.items() if k != "default"}
        if "default" in obj:
            return ExpertPlacement(obj["default"], layers)
        if not layers:
            raise ValueError("expert mapping {} has no table")
        first = _check_table(next(iter(layers.values())), "the mapping", None, False)
        return ExpertPlacement(np.arange(first.size, dtype=np.int32).reshape(first.shape),
                               layers)

    # -- reading -----------------------------------------------------------------------------
    def to_json(self) -> str:
        obj: dict[str, Any] = {"default": self.default.tolist()}
        obj.update({str(k): v.tolist() for k, v in sorted(self.per_layer.items())})
        return json.dumps(obj)

    def check(self, num_experts: int, ep_size: int) -> None:
        if (self.num_experts, self.ep_size) != (num_experts, ep_size):
            raise ValueError(
                f"the expert placement places {self.num_experts} experts on {self.ep_size} "
                f"device(s); the model has num_experts={num_experts} and ep_size={ep_size}")

    def for_layer(self, layer_id: int) -> np.ndarray:
        """``[ep_size, P_l]``: ``table[d][j]`` is the logical id of device d's row j."""
        return self.per_layer.get(layer_id, self.default)

    def physical_order(self, layer_id: int) -> np.ndarray:
        """``[P]`` int32: the logical expert stored at each row of the stacked weights."""
        return self.for_layer(layer_id).reshape(-1)

    def device_of(self, layer_id: int) -> np.ndarray:
        """``[E]``: the expert-axis device holding each logical expert (static placements:
        each expert lives on one device)."""
        if self.num_physical != self.num_experts:
            raise ValueError("device_of: a placement with replicas puts an expert on several "
                             "devices; use for_layer")
        owner = np.empty(self.num_experts, np.int32)
        owner[self.physical_order(layer_id)] = np.repeat(np.arange(self.ep_size),
                                                         self.rows_per_device)
        return owner


def _check_table(table: Table, what: str, num_experts: int | None, dynamic: bool) -> np.ndarray:
    arr = np.asarray(table)
    if arr.ndim != 2 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{what} must be a non-empty 2-D integer array [ep_size, experts / ep_size] "
            f"(row d: the experts of device d); got shape {arr.shape}, dtype {arr.dtype}")
    flat = arr.reshape(-1)
    experts = flat.size if num_experts is None else num_experts
    held = np.unique(flat)
    if dynamic:
        if held.size != experts or held[0] != 0 or held[-1] != experts - 1:
            raise ValueError(f"{what} must hold every expert 0..{experts - 1} at least once "
                             f"(and no other id)")
    elif flat.size != experts or not np.array_equal(np.sort(flat), np.arange(flat.size)):
        dup = sorted({int(e) for e in flat if np.count_nonzero(flat == e) > 1})
        lost = sorted(set(range(flat.size)) - {int(e) for e in flat})
        raise ValueError(
            f"{what} must hold every expert 0..{flat.size - 1} exactly once; "
            f"duplicated {dup[:8]}, missing or out of range {lost[:8]}")
    return arr.astype(np.int32)


# -- tables of a dynamic placement -----------------------------------------------------------------
def default_placement(num_experts: int, num_physical: int) -> np.ndarray:
    """``[P]``: the logical experts in order, then the redundant rows round-robin (0, 1, ...)."""
    return (np.arange(num_physical) % num_experts).astype(np.int32)


def replica_tables(physical_to_logical: np.ndarray, num_experts: int,
                   max_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """``[P]`` -> (replicas ``[E, max_replicas]`` physical rows, padded with the first;
    num_replicas ``[E]``). Shapes depend only on (E, R): a new placement fits the same arrays."""
    p2l = np.asarray(physical_to_logical)
    replicas = np.zeros((num_experts, max_replicas), np.int32)
    num = np.zeros(num_experts, np.int32)
    for e in range(num_experts):
        slots = np.flatnonzero(p2l == e)
        if slots.size == 0 or slots.size > max_replicas:
            raise ValueError(f"expert {e} has {slots.size} physical slots (1..{max_replicas})")
        replicas[e, :slots.size] = slots
        replicas[e, slots.size:] = slots[0]
        num[e] = slots.size
    return replicas, num


def replica_choice(topk_ids: np.ndarray, num_replicas: np.ndarray) -> np.ndarray:
    """The replica index of every assignment ``[T, k]``: ``(t + j) % num_replicas[e]`` for
    token t's j-th expert e. Consecutive tokens of the batch that pick an expert at the same
    top-k slot take its replicas in turn, so its tokens split evenly over them (not
    ``t * k + j``: with k a multiple of the replica count that would be constant per slot);
    the jitted forward computes the same (``ep_moe.physical_ids``)."""
    ids = np.asarray(topk_ids)
    index = np.arange(ids.shape[0])[:, None] + np.arange(ids.shape[1])[None, :]
    return index % np.asarray(num_replicas)[ids]


def physical_ids_np(topk_ids: np.ndarray, physical_to_logical: np.ndarray,
                    max_replicas: int) -> np.ndarray:
    """numpy twin of the forward's logical -> physical translation, for tests and figures."""
    ids = np.asarray(topk_ids)
    p2l = np.asarray(physical_to_logical)
    num_experts = int(p2l.max()) + 1
    replicas, num = replica_tables(p2l, num_experts, max_replicas)
    return replicas[ids, replica_choice(ids, num)]


def source_rows(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``[P]`` int32: for each new physical row, an old row holding the same logical expert
    (the row itself when unchanged, else the expert's first old row): the gather that moves
    the weights from placement ``old`` to ``new``."""
    old, new = np.asarray(old), np.asarray(new)
    first = {int(e): int(np.flatnonzero(old == e)[0]) for e in np.unique(old)}
    return np.array([p if old[p] == e else first[int(e)] for p, e in enumerate(new)], np.int32)


# -- --init-expert-location ------------------------------------------------------------------------
def read_init_location(path: str, num_moe_layers: int, num_experts: int, ep_size: int,
                       num_physical: int, algorithm: str = "greedy",
                       num_nodes: int = 1) -> np.ndarray:
    """``[moe_layers, P]`` from a recorder dump (``.npz`` with ``counts [layers, E]``:
    balanced by ``algorithm``) or a JSON ``{"physical_to_logical": [P] or [[P] per MoE
    layer]}`` (a bare list is accepted too)."""
    if path.endswith(".npz"):
        with np.load(path) as f:
            if "counts" not in f:
                raise ValueError(f"{path} has no 'counts' (a 'stat' recorder dump has)")
            counts = np.asarray(f["counts"], dtype=np.float64)
        if counts.ndim == 3:  # per_pass dumps: one row per pass
            counts = counts.sum(axis=0)
        if counts.shape != (num_moe_layers, num_experts):
            raise ValueError(f"{path}: counts {counts.shape}, expected "
                             f"({num_moe_layers}, {num_experts})")
        table = compute_placement(counts, ep_size, num_physical, algorithm, num_nodes=num_nodes)
    else:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        table = np.asarray(obj["physical_to_logical"] if isinstance(obj, dict) else obj)
        if table.ndim == 1:
            table = np.tile(table, (num_moe_layers, 1))
    table = np.asarray(table, dtype=np.int32)
    if table.shape != (num_moe_layers, num_physical):
        raise ValueError(f"{path}: placement {table.shape}, expected "
                         f"({num_moe_layers}, {num_physical})")
    for row in table:
        if row.min() < 0 or row.max() >= num_experts or np.unique(row).size != num_experts:
            raise ValueError(f"{path}: every row must hold each expert 0..{num_experts - 1}")
    return table
