"""New weights for a running model, in place and without recompiling.

The jitted step takes the parameters as arguments (``ModelRunner.param_leaves``), so replacing
them with arrays of the same shapes, dtypes and shardings reuses every compiled step. A source
is a checkpoint directory (``update_from_disk``) or tensors by their Hugging Face names
(``update_from_arrays``); both go through the loader's checks (names, shapes, float dtypes,
finite values), and every tensor is read, placed and checked before any parameter is swapped:
the swap is one assignment of ``runner.param_leaves``, so an update that fails at any point
before it leaves the served weights untouched, whole. JAX arrays in single-process mode take
another path with the same checks, all done before anything changes, then one parameter
replaced at a time so that the model is never held twice (``on_device_weights.py``).

Every failure of an update is a ``WeightUpdateError`` (a ValueError) with a bounded message
that names the source being loaded: the scheduler answers it as a failed update and serves on.
In a multi-node job each node reads and checks only its own blocks, so the nodes could judge
differently (a NaN in an expert only one node holds; a file one node cannot read): before the
swap they agree, in one collective that every node enters whatever happened locally, and all
fail if any did (``agree_across_nodes``), so ``multi_node.LeaderRunner.control`` (of the
``control.UpdateWeightsFrom*`` operations) sees the same outcome everywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from sgl_jax.srt.bounded_text import bound_message, name_list, short_repr
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.on_device_weights import OnDeviceUpdate
from sgl_jax.srt.model_loader.loader import ArraySource, SafetensorsCheckpoint, read_params
from sgl_jax.srt.model_loader.qwen35_names import family_source
from sgl_jax.srt.speculative.nextn import mtp_config, mtp_names, read_mtp_params

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WeightUpdateError(ValueError):
    """A weight update that did not happen; the served weights are unchanged."""


def as_update_error(source: str, fn: Callable[[], T]) -> T:
    """``fn()``, with every exception turned into a WeightUpdateError naming ``source``.

    ValueErrors (and CheckpointErrors) are the expected ones: their message says what is
    wrong. Anything else (an OSError of a file, a device out of memory, a bug) is logged with
    its traceback here and reported by type and a bounded message."""
    try:
        return fn()
    except WeightUpdateError:
        raise
    except ValueError as e:
        raise WeightUpdateError(bound_message(str(e))) from e
    except Exception as e:  # noqa: BLE001 - a failed update must never stop the server
        logger.exception("weight update from %s failed", source)
        raise WeightUpdateError(bound_message(
            f"loading {source} failed: {type(e).__name__}: {bound_message(str(e), 500)}")) from e


_AGREE_BYTES = 1024  # per node: a failed flag and the start of its message (UTF-8)


def agree_across_nodes(error: WeightUpdateError | None) -> WeightUpdateError | None:
    """The outcome every node of the job reaches for one update: this node's error, else the
    first failed node's (by rank), else None. A collective: every node calls it exactly once
    per update, failed or not. One process: ``error`` as is."""
    if jax.process_count() == 1:
        return error
    mine = np.zeros(_AGREE_BYTES, np.uint8)
    if error is not None:
        text = str(error).encode()[:_AGREE_BYTES - 1]
        mine[0] = 1
        mine[1:1 + len(text)] = np.frombuffer(text, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [nodes, _AGREE_BYTES]
    if error is not None:
        return error
    for rank, row in enumerate(every):
        if row[0]:
            text = bytes(row[1:]).rstrip(b"\0").decode(errors="replace")
            return WeightUpdateError(f"node {rank} of the job: {text}")
    return None


# Fields that may differ between checkpoints of one served model: where it lives, and what
# only the tokenizer side or the start-up dtype choice reads.
_FREE_FIELDS = {"model_path", "context_len", "eos_token_ids", "bos_token_id", "torch_dtype",
                "eplb", "num_redundant_experts"}  # the last two: set by the server (EPLB)


def config_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """What differs between two configs in a way the compiled model depends on (values in
    bounded form: ``moe_layers`` of a million layers is not a million-item message)."""
    return [
        f"{f.name} {short_repr(getattr(served, f.name))} -> {short_repr(getattr(new, f.name))}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(served, f.name) != getattr(new, f.name)
    ]


def check_compatible(served: ModelConfig, model_path: str) -> None:
    """Raises WeightUpdateError naming the differences (the first few) if ``model_path`` is
    not a readable checkpoint of the served architecture and shapes (those need a restart)."""
    new = as_update_error(model_path, lambda: ModelConfig.from_hf(model_path))
    diffs = config_differences(served, new)
    if diffs:
        raise WeightUpdateError(bound_message(
            f"{model_path} does not match the served model ({name_list(diffs, 6, 300, quote=False)}); "
            "weights can only be updated with the same architecture and shapes, restart for "
            "another model"
        ))


class WeightUpdater:
    """Swaps a ``ModelRunner``'s parameters."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.seconds = 0.0
        # Bytes of the last update that crossed between host and devices: the on-device path's
        # finiteness verdict; numpy arrays' own bytes; -1 from disk (not counted).
        self.host_bytes = -1
        self.peak_device_bytes = 0  # the on-device path's measured peak (0: not measured)

    def update_from_disk(self, model_path: str) -> int:
        """Every parameter from the checkpoint at ``model_path``; returns the count."""
        def read() -> tuple[list, int]:
            check_compatible(self.runner.model_config, model_path)
            return self._read(SafetensorsCheckpoint(model_path), partial=False)
        return self._replace(model_path, read)

    def update_from_arrays(self, arrays: dict[str, Any], measure_memory: bool = False) -> int:
        """The parameters made of the given tensors (numpy or JAX arrays by Hugging Face name;
        all experts of a stacked projection together); returns how many were replaced.
        When every one is a JAX array (they reach the runner by reference in single-process
        mode), the update runs on the devices, one parameter at a time
        (``on_device_weights``; ``measure_memory``: sample the live device bytes at its
        peak); otherwise they are read as a checkpoint is, through the host."""
        if not isinstance(arrays, dict) or not arrays:
            raise WeightUpdateError("no arrays given: pass tensors by Hugging Face name")
        mtp = mtp_names(self.runner.model_config, arrays)
        if not mtp and all(isinstance(a, jax.Array) for a in arrays.values()):
            return self._update_on_device(arrays, measure_memory)
        count = self._replace(ArraySource.where,
                              lambda: self._read(ArraySource(arrays), partial=True))
        self.host_bytes = sum(a.nbytes for a in arrays.values() if isinstance(a, np.ndarray))
        return count

    def _update_on_device(self, arrays: dict[str, jax.Array], measure_memory: bool) -> int:
        """Checks everything, agrees the outcome with the other nodes (one node in practice:
        single-process mode), then replaces the parameters one by one."""
        t0 = time.perf_counter()
        # The last step's outputs (the KV cache) ready: no step reads the parameters any
        # more. (Not every live array: in the trainer's process those are the trainer's too.)
        jax.block_until_ready([a for a in jax.tree.leaves(self.runner.kv_caches)
                               if isinstance(a, jax.Array)])
        update = OnDeviceUpdate(self.runner, arrays, measure_memory)
        error = None
        try:
            as_update_error(ArraySource.where, update.check)
        except WeightUpdateError as e:
            error = e
        error = agree_across_nodes(error)
        if error is not None:
            raise error
        as_update_error(ArraySource.where, update.apply)
        self.seconds = time.perf_counter() - t0
        self.host_bytes = update.host_bytes
        self.peak_device_bytes = update.peak_device_bytes
        return update.count

    def report(self, count: int) -> dict[str, Any]:
        """The last update's figures, as ``UpdateWeightsReqOutput`` fields."""
        return {"num_parameters": count, "seconds": self.seconds,
                "host_bytes": self.host_bytes, "peak_device_bytes": self.peak_device_bytes}

    def _replace(self, where: str, read: Callable[[], tuple[list, int]]) -> int:
        """Reads with ``read``, agrees the outcome with the other nodes, then swaps: all of
        the new parameters or, on any failure on any node, none."""
        t0 = time.perf_counter()
        # A follower node does not wait for its steps: let those in flight finish, so the
        # agreement below (a collective) never runs beside a step's collectives.
        jax.block_until_ready([a for a in jax.live_arrays() if not a.is_deleted()])
        leaves: list = []
        draft_leaves = self.runner.draft_leaves
        count, error = 0, None
        try:
            leaves, draft_leaves, count = as_update_error(where, read)
        except WeightUpdateError as e:
            error = e
        error = agree_across_nodes(error)
        if error is not None:
            raise error
        # The swap: assignments only, nothing fails after them.
        self.runner.param_leaves = leaves
        self.runner.draft_leaves = draft_leaves
        self.seconds = time.perf_counter() - t0
        self.host_bytes, self.peak_device_bytes = -1, 0
        return count

    def _read(self, source: SafetensorsCheckpoint | ArraySource,
              partial: bool) -> tuple[list, list | None, int]:
        """The runner's parameter leaves and its draft's with the new values in (not swapped
        in yet), ready on the devices, and how many parameters are new. The target reads
        ``source`` as its family names it (Qwen3.5-MoE: ``model_loader/qwen35_names.py``, which
        leaves the ``mtp.*`` tensors to the draft)."""
        target, count = self._read_target(
            family_source(self.runner.model_config, source,
                          updating=isinstance(source, ArraySource)), partial)
        draft, draft_count = self._read_mtp_draft(source, partial)
        return target, draft, count + draft_count

    def _read_mtp_draft(self, source: SafetensorsCheckpoint | ArraySource,
                        partial: bool) -> tuple[list | None, int]:
        """The tensors of the checkpoint's MTP layers (past ``num_hidden_layers``; Qwen3.5's
        ``mtp.*``) update the NEXTN draft that runs on them. Without one: a checkpoint (a
        whole model, whose MTP layers nothing serves) says so in the log; arrays given by name
        are refused, naming them, so a trainer never believes a draft was updated when none
        was."""
        runner = self.runner
        names = mtp_names(runner.model_config, source.names())
        if not names:
            return runner.draft_leaves, 0
        if runner.server_args.speculative_algorithm != "NEXTN":
            if isinstance(source, ArraySource):
                raise WeightUpdateError(
                    f"{len(names)} tensor(s) of the MTP layers (past num_hidden_layers="
                    f"{runner.model_config.num_hidden_layers}, or mtp.*) have no parameter "
                    f"to update: {name_list(names, 3)}; only a NEXTN draft "
                    "(--speculative-algorithm NEXTN) runs on them")
            logger.warning("%s: %d tensor(s) of its MTP layers not read: no NEXTN draft runs "
                           "on them", source.where, len(names))
            return runner.draft_leaves, 0
        state = jax.tree.unflatten(runner.draft_treedef, runner.draft_leaves)
        new = read_mtp_params(mtp_config(runner.model_config), runner.model_config, state,
                              runner.mesh, source, partial=partial)
        return self._with_values(state, new, runner.draft_treedef, runner.draft_leaves), len(new)

    def _read_target(self, source: SafetensorsCheckpoint | ArraySource,
                     partial: bool) -> tuple[list, int]:
        runner = self.runner
        state = jax.tree.unflatten(runner.param_treedef, runner.param_leaves)
        # The experts are stacked by the current placement (an EPLB rebalance changes it).
        new = read_params(runner.model_config, state, runner.mesh, runner.expert_placement,
                          source, partial=partial)
        return self._with_values(state, new, runner.param_treedef, runner.param_leaves), len(new)

    @staticmethod
    def _with_values(state: nnx.State, new: dict, treedef: Any, old_leaves: list) -> list:
        """``state``'s leaves with ``new``'s values in, ready on the devices."""
        for path, var in nnx.to_flat_state(state):
            if path in new:
                var.set_value(new[path])
        leaves, fresh_treedef = jax.tree.flatten(state)
        # The compiled steps were traced for exactly these: same tree, shapes, dtypes, layout.
        if fresh_treedef != treedef or any(
                (old.shape, old.dtype, old.sharding) != (fresh.shape, fresh.dtype, fresh.sharding)
                for old, fresh in zip(old_leaves, leaves, strict=True)):
            raise RuntimeError("the new parameters differ in layout from the compiled ones")
        jax.block_until_ready(leaves)
        return leaves
