"""Parallel layout: the mesh, its checks, and multi-host start-up.

The engine runs every step under one ``jax.sharding.Mesh`` with the axes ``("expert",
"tensor")`` (``make_mesh``, or a caller's mesh checked by ``check_mesh``): attention heads,
dense MLPs, expert intermediate dimensions and the vocabulary of the LM head are split over
"tensor"; the stacked experts are split over "expert". A layout that cannot shard the model
evenly is refused here, at start-up, with a message naming the number that does not divide,
instead of failing deep inside a ``device_put`` or a compiled step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from sgl_jax.srt.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)


def parallel_layout_errors(
    model_config: ModelConfig, tp_size: int, ep_size: int, num_devices: int
) -> list[str]:
    """Every reason why a ``tp_size`` x ``ep_size`` mesh cannot hold the model (empty if it can)."""
    cfg = model_config
    errors: list[str] = []
    if tp_size < 1 or ep_size < 1:
        return [f"tp_size={tp_size} and ep_size={ep_size} must both be >= 1"]
    if tp_size * ep_size > num_devices:
        errors.append(
            f"tp_size={tp_size} x ep_size={ep_size} needs {tp_size * ep_size} devices but only "
            f"{num_devices} are available"
        )
    has_moe = any(cfg.moe_layers)
    has_dense = not all(cfg.moe_layers)
    if has_moe and cfg.num_experts % ep_size:
        errors.append(
            f"ep_size={ep_size} does not divide num_experts={cfg.num_experts}: every device of "
            f"the 'expert' axis must hold the same number of experts"
        )
    if not has_moe and ep_size > 1:
        errors.append(f"ep_size={ep_size} > 1 but the model has no MoE layer")
    # (dimension, what it is) pairs split over the "tensor" axis.
    split_by_tp = [(cfg.num_attention_heads, "num_attention_heads")]
    if cfg.kv_cache_sharded:  # MLA's latent cache is replicated
        split_by_tp.append(
            (cfg.num_key_value_heads, "num_key_value_heads (the KV cache is sharded by KV head)")
        )
    if any(cfg.linear_layers):  # (value heads are a multiple of the key heads)
        split_by_tp.append((cfg.linear_num_key_heads,
                            "linear_num_key_heads (the Gated DeltaNet layers split by head)"))
    if has_moe:
        split_by_tp.append((cfg.moe_intermediate_size, "moe_intermediate_size"))
    if has_moe and cfg.num_shared_experts:
        split_by_tp.append((cfg.shared_expert_intermediate_size, "the shared experts' width"))
    if has_dense:
        split_by_tp.append((cfg.intermediate_size, "intermediate_size"))
    if not cfg.tie_word_embeddings:
        split_by_tp.append((cfg.vocab_size, "vocab_size (the LM head is sharded by vocabulary)"))
    for size, what in split_by_tp:
        if size % tp_size:
            name, _, why = what.partition(" (")  # "name (why)" -> "name=size (why)"
            errors.append(f"tp_size={tp_size} does not divide {name}={size}"
                          + (f" ({why}" if why else ""))
    return errors


def check_parallel_layout(
    model_config: ModelConfig, tp_size: int, ep_size: int, num_devices: int
) -> None:
    """Raises ValueError listing every problem of the layout, with the values that would work."""
    errors = parallel_layout_errors(model_config, tp_size, ep_size, num_devices)
    if not errors:
        return
    cfg = model_config
    tp_ok = [
        t for t in range(1, num_devices + 1)
        if not parallel_layout_errors(cfg, t, 1, num_devices)
    ]
    ep_ok = [
        e for e in range(1, num_devices + 1)
        if not parallel_layout_errors(cfg, 1, e, num_devices)
    ]
    raise ValueError(
        "invalid parallel layout: " + "; ".join(errors)
        + f". With {num_devices} device(s) this model accepts tp_size in {tp_ok} and ep_size "
        f"in {ep_ok} (tp_size x ep_size <= {num_devices})"
    )


def select_devices(devices: Sequence[Any], indexes: Sequence[int] | None) -> list[Any]:
    """``devices`` picked by position (``device_indexes``, as SGLang-JAX), or all of them."""
    devices = list(devices)
    if indexes is None:
        return devices
    bad = [i for i in indexes if not 0 <= i < len(devices)]
    if bad:
        raise ValueError(
            f"device_indexes={list(indexes)}: {bad} not in [0, {len(devices)}) "
            f"({len(devices)} {devices[0].platform} device(s) visible)")
    return [devices[i] for i in indexes]


def make_mesh(devices: Sequence[Any], tp_size: int, ep_size: int) -> Mesh:
    """The ``("expert", "tensor")`` mesh on the first ``tp_size * ep_size`` devices, the
    "tensor" axis over neighbouring devices. On a multi-host job the mesh must hold every
    device (each host runs its share of every step) and "tensor" must stay within a host
    (its all-reduces run in every attention and MoE block: they want the fastest links)."""
    need = tp_size * ep_size
    if need > len(devices):
        raise ValueError(
            f"tp_size={tp_size} x ep_size={ep_size} needs {need} devices; {len(devices)} "
            f"available ({devices[0].platform})"
        )
    hosts = {d.process_index for d in devices}
    if len(hosts) > 1:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        per_host = len(devices) // len(hosts)
        if need != len(devices):
            raise ValueError(
                f"a {len(hosts)}-host job needs tp_size x ep_size = every device "
                f"({len(devices)}: {per_host} per host); got tp_size={tp_size} x "
                f"ep_size={ep_size} = {need}")
        if per_host % tp_size:
            raise ValueError(
                f"tp_size={tp_size} must divide the {per_host} devices of each host: tensor "
                f"parallelism stays within a host (span hosts with ep_size)")
    # Host by host: a row of the grid ("tensor") never straddles two hosts.
    grid = np.array(list(devices)[:need]).reshape(ep_size, tp_size)
    return Mesh(grid, ("expert", "tensor"))


def check_mesh(mesh: Mesh, tp_size: int, ep_size: int) -> Mesh:
    """A caller's mesh (``Engine(mesh=...)``), checked against the layout; returned as is.

    The model's partition specs name the axes, so the mesh must have exactly the axes
    ``"expert"`` and ``"tensor"`` (in either order) with the sizes ``ep_size`` and ``tp_size``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, not {type(mesh).__name__}")
    if set(mesh.axis_names) != {"expert", "tensor"}:
        raise ValueError(
            f"the mesh has the axes {tuple(mesh.axis_names)}; the engine needs exactly "
            "('expert', 'tensor') (experts are split over 'expert', attention heads, MLP "
            "widths and the vocabulary over 'tensor'): build one over the same devices, "
            "e.g. Mesh(devices.reshape(ep, tp), ('expert', 'tensor'))")
    got = (mesh.shape["tensor"], mesh.shape["expert"])
    if got != (tp_size, ep_size):
        raise ValueError(
            f"the mesh is 'tensor' {got[0]} x 'expert' {got[1]} but tp_size={tp_size}, "
            f"ep_size={ep_size}; give tp_size and ep_size equal to the mesh's axis sizes "
            "(or leave them out: Engine(mesh=...) takes them from the mesh)")
    if len({d.process_index for d in mesh.devices.flat}) > 1:
        raise ValueError("a mesh over several hosts is for multi-node jobs (--nnodes); "
                         "Engine(mesh=...) runs on the devices of this process")
    return mesh


def maybe_initialize_distributed(
    dist_init_addr: str | None, nnodes: int, node_rank: int
) -> bool:
    """Joins a multi-host JAX job when ``nnodes > 1``; returns whether it did.

    Must run before the first JAX computation of the process (``jax.devices()`` included):
    afterwards the backend is fixed to this host's devices. Every node runs the same command
    with its own ``node_rank``; ``dist_init_addr`` (``host:port``) is node 0's coordinator.
    """
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} must be in [0, nnodes={nnodes})")
    if nnodes == 1:
        return False
    if not dist_init_addr:
        raise ValueError(
            f"nnodes={nnodes} needs dist_init_addr (host:port of node 0's coordinator)"
        )
    # Node 0's coordinator listens on the address given, not on every interface (JAX's
    # default, [::]:port): an engine told 10.0.0.5:port is not reachable on its other ones.
    jax.distributed.initialize(
        coordinator_address=dist_init_addr, num_processes=nnodes, process_id=node_rank,
        coordinator_bind_address=dist_init_addr if node_rank == 0 else None,
    )
    logger.info(
        "joined %d-node JAX job as node %d: %d local / %d global devices",
        nnodes, node_rank, jax.local_device_count(), jax.device_count(),
    )
    return True
