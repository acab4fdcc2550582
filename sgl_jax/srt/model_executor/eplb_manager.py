"""EPLB at run time (``--enable-eplb``): the dynamic expert placement, and its rebalances.

The model's MoE blocks hold ``P = E + R`` physical expert rows and the placement as data
(``layers/moe/placement.py``). A rebalance computes a new placement from the recorder's
per-expert counts (``layers/moe/balancing.py``) and applies it on the device: one jitted
gather over the physical rows of every stacked expert weight (fixed shapes: compiled once)
and new placement arrays. The step is not recompiled. Every node of a multi-host job runs the
same rebalances from its copy of the replicated counts, so the shards stay consistent.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.balancing import compute_placement, device_load, imbalance
from sgl_jax.srt.layers.moe.ep_moe import layer_of
from sgl_jax.srt.layers.moe.placement import ExpertPlacement, read_init_location, source_rows
from sgl_jax.srt.model_loader.loader import location_values

logger = logging.getLogger(__name__)

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class EplbManager:
    """The current placement, how many passes ran and how many rebalances were applied."""

    def __init__(self, config: ModelConfig, mesh: Mesh, algorithm: str, num_nodes: int,
                 rebalance_every: int, init_location: str | None) -> None:
        self.config, self.mesh = config, mesh
        self.algorithm, self.num_nodes = algorithm, num_nodes
        self.rebalance_every = rebalance_every  # passes between automatic rebalances; 0: never
        self.passes = 0
        self.rebalances = 0
        self.placement = self._initial_placement(init_location)
        self._move_rows: Any = None  # the jitted gather of a rebalance (built on first use)

    def _initial_placement(self, init_location: str | None) -> ExpertPlacement:
        cfg, ep_size = self.config, self.mesh.shape["expert"]
        num_physical = cfg.num_physical_experts
        if num_physical % ep_size:
            raise ValueError(
                f"num_experts={cfg.num_experts} + ep_num_redundant_experts="
                f"{cfg.num_redundant_experts} = {num_physical} physical experts must be a "
                f"multiple of ep_size={ep_size}")
        if not init_location:
            return ExpertPlacement.redundant(cfg.num_experts, num_physical, ep_size)
        tables = read_init_location(init_location, len(cfg.moe_layer_ids), cfg.num_experts,
                                    ep_size, num_physical, self.algorithm, self.num_nodes)
        return ExpertPlacement.from_layers(dict(zip(cfg.moe_layer_ids, tables, strict=True)),
                                           cfg.num_experts, ep_size)

    def after_pass(self) -> bool:
        """Counts a forward pass; True when an automatic rebalance is due."""
        self.passes += 1
        return bool(self.rebalance_every) and self.passes % self.rebalance_every == 0

    def rebalance(self, load: np.ndarray, param_leaves: list, param_treedef: Any,
                  ) -> tuple[list, dict[str, Any]]:
        """A new placement from ``load`` ``[moe_layers, E]``, applied: returns the parameter
        leaves (shapes and shardings unchanged) and the per-layer imbalance before and after
        (each replica taking load / replicas) with the new tables."""
        cfg, ep_size = self.config, self.mesh.shape["expert"]
        load = np.asarray(load, dtype=np.float64)
        layers = list(cfg.moe_layer_ids)
        old = np.stack([self.placement.physical_order(i) for i in layers])
        new = compute_placement(load, ep_size, cfg.num_physical_experts, self.algorithm,
                                num_nodes=self.num_nodes)
        placement = ExpertPlacement.from_layers(dict(zip(layers, new, strict=True)),
                                                cfg.num_experts, ep_size)
        if not np.array_equal(old, new):  # an unchanged placement moves nothing
            sources = {layer: source_rows(o, n) for layer, o, n in zip(layers, old, new,
                                                                       strict=True)}
            param_leaves = self._apply(placement, sources, param_leaves, param_treedef)
        self.placement = placement
        self.rebalances += 1
        result = {
            "imbalance_before": imbalance(device_load(load, old, ep_size)).tolist(),
            "imbalance_after": imbalance(device_load(load, new, ep_size)).tolist(),
            "physical_to_logical": new.tolist(),
        }
        logger.info("EPLB rebalance %d: imbalance %s -> %s", self.rebalances,
                    np.round(result["imbalance_before"], 3), np.round(result["imbalance_after"], 3))
        return param_leaves, result

    def _apply(self, placement: ExpertPlacement, sources: dict[int, np.ndarray],
               param_leaves: list, param_treedef: Any) -> list:
        """The leaves with every stacked expert weight's physical rows gathered from
        ``sources[layer]`` and the placement arrays of ``placement``."""
        state = jax.tree.unflatten(param_treedef, param_leaves)
        flat = list(nnx.to_flat_state(state))
        moved = [(path, var) for path, var in flat if path[-1] in _EXPERT_WEIGHTS]
        if self._move_rows is None:
            shardings = [var.get_value().sharding for _, var in moved]
            self._move_rows = jax.jit(
                lambda ws, idx: [jnp.take(w, i, axis=0) for w, i in zip(ws, idx, strict=True)],
                out_shardings=shardings)
        with jax.set_mesh(self.mesh):
            rows = self._move_rows([var.get_value() for _, var in moved],
                                   [sources[layer_of(path)] for path, _ in moved])
        for (_, var), value in zip(moved, rows, strict=True):
            var.set_value(value)
        by_path = dict(flat)
        for path, value in location_values(self.config, state, self.mesh, placement).items():
            by_path[path].set_value(value)
        leaves, treedef = jax.tree.flatten(state)
        assert treedef == param_treedef
        for before, after in zip(param_leaves, leaves, strict=True):
            assert (before.shape, before.dtype, before.sharding) == (
                after.shape, after.dtype, after.sharding)
        return leaves
