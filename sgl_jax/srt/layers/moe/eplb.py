"""EPLB: expert-parallel load balancing with redundant experts (pure numpy placement).

A MoE layer with ``E`` logical experts holds ``P = E + R`` physical expert slots (``R`` =
``--ep-num-redundant-experts``), ``P / ep_size`` per expert-axis device: device ``d`` holds
physical slots ``[d * P_l, (d + 1) * P_l)``. A placement is, per MoE layer, the table
``physical_to_logical [P]`` (the logical expert whose weights slot p holds). Every logical
expert has at least one slot; a hot expert may have several (replicas), and the tokens routed
to it are split over them deterministically (``replica_choice``).

Algorithms (``--eplb-algorithm``), from a per-layer logical load ``[L, E]`` (token counts):

- ``greedy``: (1) replication: every expert gets one slot, each of the R extra slots goes to
  the expert with the highest load per replica (``load / replicas``; ties: lowest id);
  (2) packing: the P replicas, each weighing ``load / replicas``, go heaviest first onto the
  least loaded device that still has a free slot (LPT with equal slot counts; ties: a device
  not yet holding that expert, then the lowest device).
- ``hierarchical`` (in the spirit of DeepSeek's EPLB): the experts form ``num_groups``
  contiguous groups and the devices ``num_nodes`` contiguous device groups; (1) the expert
  groups are packed onto device groups by group load (equal group counts per device group);
  (2) within each device group its experts are replicated into its ``P / num_nodes`` slots
  and packed onto its devices as in ``greedy``. Replicas never leave their device group (on
  a multi-node mesh: the node), so a token's expert traffic stays inside one group.

The imbalance of a placement is ``max / mean`` of the per-device load, where each replica
takes ``load / replicas`` of its expert's load (``device_load``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

EPLB_ALGORITHMS = ("greedy", "hierarchical")


# -- algorithms -----------------------------------------------------------------------------------
def replicate(load: np.ndarray | Sequence[float], num_slots: int) -> np.ndarray:
    """``[E]`` replica counts (each >= 1, summing to ``num_slots``): the extra slots go one by
    one to the expert with the highest load per replica (ties: lowest id)."""
    load = np.asarray(load, dtype=np.float64)
    if num_slots < load.size:
        raise ValueError(f"{num_slots} physical slots cannot hold {load.size} experts")
    counts = np.ones(load.size, dtype=np.int64)
    for _ in range(num_slots - load.size):
        counts[int(np.argmax(load / counts))] += 1
    return counts


def pack(weights: np.ndarray | Sequence[float], num_bins: int,
         labels: Sequence[int] | None = None) -> list[list[int]]:
    """Items (by index) into ``num_bins`` bins of ``len(weights) / num_bins`` each: heaviest
    first (stable) onto the lightest bin with room; ties prefer a bin without an item of the
    same label (replicas of one expert), then the lowest bin."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size % num_bins:
        raise ValueError(f"{w.size} items do not split evenly into {num_bins} bins")
    per_bin = w.size // num_bins
    labels = list(range(w.size)) if labels is None else list(labels)
    totals = np.zeros(num_bins)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in np.argsort(-w, kind="stable"):
        open_bins = [b for b in range(num_bins) if len(bins[b]) < per_bin]
        best = min(open_bins, key=lambda b: (
            totals[b], any(labels[j] == labels[i] for j in bins[b]), b))
        bins[best].append(int(i))
        totals[best] += w[i]
    return bins


def _greedy_layer(load: np.ndarray, num_devices: int, num_slots: int,
                  experts: np.ndarray | None = None) -> np.ndarray:
    """``physical_to_logical [num_slots]`` of one layer (or of one device group's ``experts``)."""
    experts = np.arange(load.size) if experts is None else experts
    counts = replicate(load, num_slots)
    labels = np.repeat(np.arange(load.size), counts)
    weights = (load / counts)[labels]
    bins = pack(weights, num_devices, labels)
    return np.concatenate([np.sort(experts[labels[b]]) for b in bins]).astype(np.int32)


def greedy_placement(load: np.ndarray, ep_size: int, num_physical: int) -> np.ndarray:
    """``[L, P]`` physical-to-logical tables from a logical load ``[L, E]``."""
    load = _check_load(load, ep_size, num_physical)
    return np.stack([_greedy_layer(row, ep_size, num_physical) for row in load])


def hierarchical_placement(load: np.ndarray, ep_size: int, num_physical: int,
                           num_groups: int, num_nodes: int) -> np.ndarray:
    """``[L, P]``: expert groups onto device groups, then replicate and pack within each."""
    load = _check_load(load, ep_size, num_physical)
    num_experts = load.shape[1]
    if num_experts % num_groups or num_groups % num_nodes or ep_size % num_nodes:
        raise ValueError(f"hierarchical EPLB needs num_groups={num_groups} | E={num_experts}, "
                         f"num_nodes={num_nodes} | num_groups and num_nodes | ep={ep_size}")
    group_size = num_experts // num_groups
    slots_per_node = num_physical // num_nodes
    if slots_per_node * num_nodes != num_physical or slots_per_node < num_experts // num_nodes:
        raise ValueError(f"{num_physical} slots do not split over {num_nodes} device groups")
    out = []
    for row in load:
        group_load = row.reshape(num_groups, group_size).sum(axis=1)
        node_groups = pack(group_load, num_nodes)
        parts = []
        for groups in node_groups:
            experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                      for g in sorted(groups)])
            parts.append(_greedy_layer(row[experts], ep_size // num_nodes, slots_per_node,
                                       experts))
        out.append(np.concatenate(parts))
    return np.stack(out)


def compute_placement(load: np.ndarray, ep_size: int, num_physical: int,
                      algorithm: str = "greedy", num_groups: int | None = None,
                      num_nodes: int = 1) -> np.ndarray:
    """``[L, P]`` int32 by ``--eplb-algorithm``. hierarchical: ``num_groups`` defaults to
    ep_size expert groups when that divides E (else num_nodes)."""
    if algorithm == "greedy":
        return greedy_placement(load, ep_size, num_physical)
    if algorithm == "hierarchical":
        num_experts = np.shape(load)[-1]
        groups = num_groups or (ep_size if num_experts % ep_size == 0 else num_nodes)
        return hierarchical_placement(load, ep_size, num_physical, groups, num_nodes)
    raise ValueError(f"unknown EPLB algorithm {algorithm!r}; use one of {EPLB_ALGORITHMS}")


def _check_load(load: Any, ep_size: int, num_physical: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 1:
        load = load[None]
    if load.ndim != 2 or (load < 0).any():
        raise ValueError(f"load must be [layers, experts] of counts >= 0; got {load.shape}")
    if num_physical % ep_size or num_physical < load.shape[1]:
        raise ValueError(f"num_physical={num_physical} must be >= num_experts="
                         f"{load.shape[1]} and a multiple of ep_size={ep_size}")
    return load


def default_placement(num_experts: int, num_physical: int) -> np.ndarray:
    """``[P]``: the logical experts in order, then replicas round-robin (0, 1, ...)."""
    return (np.arange(num_physical) % num_experts).astype(np.int32)


# -- tables the forward uses ----------------------------------------------------------------------
def replica_tables(physical_to_logical: np.ndarray, num_experts: int,
                   max_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """``[P]`` -> (replicas ``[E, max_replicas]`` physical slots, padded with the first;
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
    """``[P]`` int32: for each new physical slot, an old slot holding the same logical expert
    (the slot itself when unchanged, else the expert's first old slot): the gather that moves
    the weights from placement ``old`` to ``new``."""
    old, new = np.asarray(old), np.asarray(new)
    first = {int(e): int(np.flatnonzero(old == e)[0]) for e in np.unique(old)}
    return np.array([p if old[p] == e else first[int(e)] for p, e in enumerate(new)], np.int32)


# -- imbalance ------------------------------------------------------------------------------------
def device_load(load: np.ndarray, physical_to_logical: np.ndarray, ep_size: int) -> np.ndarray:
    """``[L, ep_size]``: each replica takes ``load / replicas`` of its expert's load."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    p2l = np.atleast_2d(np.asarray(physical_to_logical))
    out = np.zeros((load.shape[0], ep_size))
    for layer, (row, table) in enumerate(zip(load, p2l, strict=True)):
        counts = np.bincount(table, minlength=row.size)
        per_slot = row[table] / counts[table]
        out[layer] = per_slot.reshape(ep_size, -1).sum(axis=1)
    return out


def imbalance(per_device: np.ndarray) -> np.ndarray:
    """``[L]`` max / mean of per-device loads ``[L, ep]`` (1.0: perfect; layers without load: 1)."""
    per_device = np.atleast_2d(np.asarray(per_device, dtype=np.float64))
    mean = per_device.mean(axis=1)
    return np.where(mean > 0, per_device.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)


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


class EplbPlacement:
    """Per MoE layer ``physical_to_logical [P]``; the loader's ``physical_order`` source
    (duck-typed like ``ExpertMapping``: it stacks row p from logical expert table[p])."""

    def __init__(self, tables: dict[int, np.ndarray], num_experts: int, ep_size: int) -> None:
        self.tables = {int(k): np.asarray(v, np.int32) for k, v in tables.items()}
        self.num_experts, self.ep_size = num_experts, ep_size
        self.num_physical = next(iter(self.tables.values())).size if self.tables else num_experts

    @staticmethod
    def default(config: Any, ep_size: int) -> EplbPlacement:
        table = default_placement(config.num_experts, config.num_physical_experts)
        return EplbPlacement({i: table for i in config.moe_layer_ids}, config.num_experts,
                             ep_size)

    def physical_order(self, layer_id: int) -> np.ndarray:
        return self.tables[layer_id]

    def check(self, num_experts: int, ep_size: int) -> None:
        if (num_experts, ep_size) != (self.num_experts, self.ep_size):
            raise ValueError(f"EPLB placement for E={self.num_experts}, ep={self.ep_size}; "
                             f"the model has E={num_experts}, ep={ep_size}")
