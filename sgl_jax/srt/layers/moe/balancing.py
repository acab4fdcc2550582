"""Choosing where experts go from how much they are used (pure numpy): one module for every
balancing algorithm.

A load is, per MoE layer, the token count of each logical expert ``[L, E]`` (from routed
experts or the expert-distribution recorder). A result is, per layer, the table
``physical_to_logical [P]`` of an :class:`~sgl_jax.srt.layers.moe.placement.ExpertPlacement`
(``P = E + R``; ``R`` redundant rows, 0 for a static placement), ``P / ep_size`` rows per
expert-axis device.

Algorithms (``--eplb-algorithm``):

- ``greedy``: (1) replication: every expert gets one row, each of the R extra rows goes to
  the expert with the highest load per replica (``load / replicas``; ties: lowest id);
  (2) packing: the P replicas, each weighing ``load / replicas``, go heaviest first onto the
  least loaded device that still has a free row (LPT with equal row counts; ties: a device
  not yet holding that expert, then the lowest device). With ``R = 0`` this is
  :func:`balanced_mapping`, the static placement ``--ep-expert-mapping`` takes.
- ``hierarchical`` (in the spirit of DeepSeek's EPLB): the experts form ``num_groups``
  contiguous groups and the devices ``num_nodes`` contiguous device groups; (1) the expert
  groups are packed onto device groups by group load (equal group counts per device group);
  (2) within each device group its experts are replicated into its ``P / num_nodes`` rows
  and packed onto its devices as in ``greedy``. Replicas never leave their device group (on
  a multi-node mesh: the node), so a token's expert traffic stays inside one group.

The imbalance of a placement is ``max / mean`` of the per-device load, where each replica
takes ``load / replicas`` of its expert's load (``device_load``).
"""

from __future__ import annotations

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

def balanced_mapping(expert_load: np.ndarray | Sequence[float], ep_size: int) -> np.ndarray:
    """A static placement's ``[ep_size, E / ep_size]`` table that spreads ``expert_load``
    (tokens per expert) evenly: ``greedy`` without redundant rows (each device's experts
    sorted by id)."""
    load = np.asarray(expert_load, dtype=np.float64)
    if load.size % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide num_experts={load.size}")
    return greedy_placement(load, ep_size, load.size)[0].reshape(ep_size, -1)


# -- loads and imbalance --------------------------------------------------------------------------
def expert_load(routed_experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Routed-experts rows ``[..., num_layers, k]`` -> tokens per expert ``[num_layers, E]``
    (rows of -1, layers without a router, count nothing)."""
    ids = np.asarray(routed_experts).reshape(-1, *np.shape(routed_experts)[-2:])
    out = np.zeros((ids.shape[1], num_experts), np.int64)
    for layer in range(ids.shape[1]):
        flat = ids[:, layer].reshape(-1)
        out[layer] = np.bincount(flat[flat >= 0], minlength=num_experts)
    return out


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
