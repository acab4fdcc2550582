"""New weights for a running model, in place and without recompiling.

The jitted step takes the parameters as arguments (``ModelRunner.param_leaves``), so replacing
them with arrays of the same shapes, dtypes and shardings reuses every compiled step. A source
is a checkpoint directory (``update_from_disk``) or tensors by their Hugging Face names
(``update_from_arrays``); both go through the loader's checks, and every tensor is read and
placed before any parameter is swapped, so a bad source leaves the served weights untouched.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.ep_moe import ExpertMapping
from sgl_jax.srt.model_loader.loader import ArraySource, SafetensorsCheckpoint, read_params

# Fields that may differ between checkpoints of one served model: where it lives, and what
# only the tokenizer side or the start-up dtype choice reads.
_FREE_FIELDS = {"model_path", "context_len", "eos_token_ids", "bos_token_id", "torch_dtype",
                "eplb", "num_redundant_experts"}  # the last two: set by the server (EPLB)


def config_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """What differs between two configs in a way the compiled model depends on."""
    return [
        f"{f.name} {getattr(served, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(served, f.name) != getattr(new, f.name)
    ]


def check_compatible(served: ModelConfig, model_path: str) -> None:
    """Raises ValueError naming every difference if ``model_path`` is not a checkpoint of the
    served architecture and shapes (those need a restart)."""
    new = ModelConfig.from_hf(model_path)
    diffs = config_differences(served, new)
    if diffs:
        raise ValueError(
            f"{model_path} does not match the served model ({'; '.join(diffs)}); weights can "
            "only be updated with the same architecture and shapes, restart for another model"
        )


class WeightUpdater:
    """Swaps a ``ModelRunner``'s parameters."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        cfg, mesh = runner.model_config, runner.mesh
        self.mapping = runner.expert_mapping or ExpertMapping.contiguous(
            cfg.num_experts, mesh.shape["expert"])

    def update_from_disk(self, model_path: str) -> int:
        """Every parameter from the checkpoint at ``model_path``; returns the count."""
        check_compatible(self.runner.model_config, model_path)
        return self._replace(SafetensorsCheckpoint(model_path), partial=False)

    def update_from_arrays(self, arrays: dict[str, Any]) -> int:
        """The parameters made of the given tensors (numpy or JAX arrays by Hugging Face name;
        all experts of a stacked projection together); returns how many were replaced."""
        if not arrays:
            raise ValueError("no arrays given")
        return self._replace(ArraySource(arrays), partial=True)

    def _replace(self, source: SafetensorsCheckpoint | ArraySource, partial: bool) -> int:
        runner = self.runner
        t0 = time.perf_counter()
        state = jax.tree.unflatten(runner.param_treedef, runner.param_leaves)
        # EPLB: the experts are stacked by the current placement (a rebalance changes it).
        mapping = getattr(runner, "eplb_placement", None) or self.mapping
        new = read_params(runner.model_config, state, runner.mesh, mapping, source,
                          partial=partial)
        for path, var in nnx.to_flat_state(state):
            if path in new:
                var.set_value(new[path])
        leaves, treedef = jax.tree.flatten(state)
        # The compiled steps were traced for exactly these: same tree, shapes, dtypes, layout.
        assert treedef == runner.param_treedef
        for old, fresh in zip(runner.param_leaves, leaves, strict=True):
            assert (old.shape, old.dtype, old.sharding) == (fresh.shape, fresh.dtype,
                                                            fresh.sharding)
        jax.block_until_ready(leaves)
        runner.param_leaves = leaves
        self.seconds = time.perf_counter() - t0
        return len(new)
