"""Safetensors checkpoint -> sharded model parameters.

The model is first built abstractly (``nnx.eval_shape``: shapes, dtypes and partition specs,
no memory); every parameter path is then mapped to the Hugging Face tensor(s) it comes from,
checked, converted and placed on the mesh. A checkpoint with a missing, unexpected,
mis-shaped or non-float tensor fails before anything is placed, and one with a NaN or an
infinity (after conversion to the parameter's dtype) before anything is returned, naming the
tensor and the checkpoint. Messages quote names from the files only in bounded form.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from tqdm import tqdm

from sgl_jax.srt.bounded_text import bound_message, name_list, short_repr
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.ep_moe import ExpertLocation, apply_placement, layer_of
from sgl_jax.srt.layers.moe.placement import ExpertPlacement, replica_tables
from sgl_jax.srt.model_loader import fused_experts
from sgl_jax.srt.model_loader.fused_experts import FUSED
from sgl_jax.srt.model_loader.qwen35_names import family_source
from sgl_jax.srt.models.registry import get_model_class

logger = logging.getLogger(__name__)

Path = tuple[str | int, ...]
_STACKED_EXPERTS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def is_stacked_experts(path: Path) -> bool:
    """Whether the parameter at ``path`` stacks one Hugging Face tensor per expert."""
    return path[-1] in _STACKED_EXPERTS


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def _per_expert(names: Sequence[str]) -> bool:
    """Whether ``names`` are one tensor per expert (``...experts.<e>.<proj>.weight``), the
    stacked layout; not fused ones (``experts.gate_up_proj``) nor ``experts.down_proj_bias``."""
    return bool(_PER_EXPERT.search(names[0]))


def _fused(var: nnx.Variable) -> tuple[str, str] | None:
    return var.get_metadata().get(FUSED)


class CheckpointError(ValueError):
    pass


class SafetensorsCheckpoint:
    """Name-indexed access to the tensors of all ``*.safetensors`` files of a directory.

    Each file is opened once (memory-mapped) for the whole load: a stacked expert parameter
    reads hundreds of tensors, and reopening the file for each costs far more than reading.
    """

    def __init__(self, model_path: str) -> None:
        self.where = model_path  # named in every error about this source
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise CheckpointError(f"no *.safetensors file in {model_path}")
        self._handles: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        for file in files:
            try:
                handle = safe_open(file, framework="numpy")
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {file}: {bound_message(str(e), 300)}") from e
            self._handles[file] = handle
            for name in names:
                self._where[name] = handle

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def is_float(self, name: str) -> tuple[bool, str]:
        """Whether the tensor is stored as floating point, and its safetensors dtype name."""
        dtype = self._handle(name).get_slice(name).get_dtype()  # "F32", "BF16", "I64", ...
        return dtype.startswith(("F", "BF")), dtype

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of a tensor, reading only that block from the file."""
        return self._handle(name).get_slice(name)[index]

    def _handle(self, name: str) -> Any:
        if name not in self._where:
            raise CheckpointError(f"{self.where} lacks the tensor {short_repr(name, 200)}")
        return self._where[name]


def hf_sources(
    path: Path, var: nnx.Variable, num_experts: int, expert_order: Sequence[int] | None = None,
    present: set[str] | None = None,
) -> tuple[list[str], bool]:
    """The HF tensor names a parameter is made of, and whether they are transposed.

    The name is the parameter's path, with ``.weight`` added to linear layers and the
    embedding (HF stores linear weights ``[out, in]``: transposed), unless the parameter's
    ``hf`` metadata gives its name relative to its parent and its orientation
    (``models/common.param``). Stacked experts (``w_gate``/``w_up``/``w_down``, whose ``hf`` names
    the projection) are read in ``expert_order`` (the layer's physical order under the
    device-expert mapping, default 0..E-1), so each expert-axis device's shard holds its experts.
    An ``hf`` name starting with ``../`` is relative to the parent's parent (MiniMax-M2's
    correction bias, held by the MoE block, read by its router). A parameter built from
    fused expert tensors (gpt-oss: ``fused`` metadata) names those (``fused_experts``;
    ``present``: the source's names, which say whether they are MXFP4).
    """
    name = ".".join(str(p) for p in path)
    prefix = ".".join(str(p) for p in path[:-1])
    leaf = path[-1]
    hf = var.get_metadata().get("hf")
    fused = _fused(var)
    if fused is not None:
        return fused_experts.fused_sources(prefix, fused, present or set()), False
    if hf and hf[0].startswith("../"):
        prefix, hf = prefix.rpartition(".")[0], (hf[0][3:], hf[1])
    if leaf in _STACKED_EXPERTS:
        proj = hf[0] if hf else _STACKED_EXPERTS[str(leaf)]
        order = range(num_experts) if expert_order is None else expert_order
        return [f"{prefix}.experts.{e}.{proj}.weight" for e in order], True
    if hf:
        return [f"{prefix}.{hf[0]}" if prefix else hf[0]], bool(hf[1])
    if leaf == "weight":  # norms
        return [name], False
    if leaf == "embed_tokens":
        return [f"{name}.weight"], False
    return [f"{name}.weight"], True  # linear layers: HF stores [out, in]


def _flat_params(state: nnx.State) -> Iterator[tuple[Path, nnx.Variable]]:
    yield from nnx.to_flat_state(state)


def _param_sharding(var: nnx.Variable, mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(var.get_metadata().get("out_sharding") or ())))


def _checked_placement(config: ModelConfig, placement: ExpertPlacement | None,
                       ep_size: int) -> ExpertPlacement:
    """``placement`` checked against the model; by default EPLB's placement before any load
    is known, or the contiguous static one."""
    if placement is None:
        if config.eplb:
            return ExpertPlacement.redundant(config.num_experts, config.num_physical_experts,
                                             ep_size)
        return ExpertPlacement.contiguous(config.num_experts, ep_size)
    placement.check(config.num_experts, ep_size)
    if placement.dynamic != config.eplb:
        raise ValueError("an EPLB model needs a dynamic expert placement, any other a static one")
    return placement


def abstract_model(
    config: ModelConfig, mesh: Mesh, dtype: jnp.dtype,
    placement: ExpertPlacement | None = None,
) -> nnx.Module:
    """The model with ``jax.ShapeDtypeStruct`` parameters sharded over ``mesh``: no checkpoint
    is read and nothing is allocated (for ahead-of-time compilation, ``tools/aot_report``)."""
    model_cls = get_model_class(config.architecture)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(config, dtype)))
    for _, var in _flat_params(state):
        value = var.get_value()
        var.set_value(
            jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=_param_sharding(var, mesh))
        )
    model = nnx.merge(graphdef, state)
    placement = _checked_placement(config, placement, mesh.shape["expert"])
    if not placement.dynamic:  # a dynamic placement is data: location_values
        apply_placement(model, placement)
    return model


class ArraySource:
    """Tensors given by name (numpy or JAX arrays), read like a checkpoint."""

    where = "the arrays"

    def __init__(self, arrays: dict[str, Any]) -> None:
        for name, value in arrays.items():
            if not isinstance(name, str):
                raise CheckpointError(f"array names must be strings (Hugging Face tensor "
                                      f"names), not {short_repr(name)}")
            if not isinstance(value, (np.ndarray, jax.Array)):
                raise CheckpointError(f"array {short_repr(name, 200)} is a "
                                      f"{type(value).__name__}; give a numpy or JAX array")
        self._arrays = arrays

    def names(self) -> set[str]:
        return set(self._arrays)

    def get(self, name: str) -> Any:
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._arrays[name].shape)

    def is_float(self, name: str) -> tuple[bool, str]:
        return _float_dtype(np.dtype(self._arrays[name].dtype))

    def read(self, name: str, index: tuple[slice, ...]) -> Any:
        return self._arrays[name][index]


@functools.cache
def _float_dtype(dtype: np.dtype) -> tuple[bool, str]:
    # Cached: a model's update can give tens of thousands of tensors of one or two dtypes.
    return bool(jnp.issubdtype(dtype, jnp.floating)), dtype.name


def load_model(
    config: ModelConfig, mesh: Mesh, dtype: jnp.dtype,
    placement: ExpertPlacement | None = None,
) -> nnx.Module:
    """Builds the model for ``config`` with the checkpoint's weights, sharded over ``mesh``;
    the experts of each MoE layer are stacked by ``placement`` (default: contiguous, or
    EPLB's initial one)."""
    model_cls = get_model_class(config.architecture)
    abstract = nnx.eval_shape(lambda: model_cls(config, dtype))
    graphdef, state = nnx.split(abstract)
    placement = _checked_placement(config, placement, mesh.shape["expert"])
    source = family_source(config, SafetensorsCheckpoint(config.model_path))
    pure = read_params(config, state, mesh, placement, source)
    if placement.dynamic:
        pure.update(location_values(config, state, mesh, placement))
    for path, var in _flat_params(state):
        var.set_value(pure[path])
    model = nnx.merge(graphdef, state)
    if not placement.dynamic:
        apply_placement(model, placement)  # the order the experts were just stacked in
    return model


def location_values(config: ModelConfig, state: nnx.State, mesh: Mesh,
                    placement: ExpertPlacement) -> dict[Path, jax.Array]:
    """EPLB: every MoE block's ``replicas`` / ``num_replicas`` for ``placement``, replicated."""
    out: dict[Path, jax.Array] = {}
    for path, var in _flat_params(state):
        if isinstance(var, ExpertLocation):
            replicas, num = replica_tables(placement.physical_order(layer_of(path)),
                                           config.num_experts, config.num_redundant_experts + 1)
            value = replicas if path[-1] == "replicas" else num
            out[path] = jax.device_put(value, _param_sharding(var, mesh))
    return out


# One parameter to read: its path, its (abstract or loaded) variable, the Hugging Face tensors
# it is made of (stacked experts: in the placement's physical order) and whether they are
# stored transposed.
ParamPlan = tuple[Path, nnx.Variable, list[str], bool]


def plan_params(
    config: ModelConfig, state: nnx.State, placement: ExpertPlacement,
    source: SafetensorsCheckpoint | ArraySource, partial: bool = False,
) -> list[ParamPlan]:
    """The parameters of ``state`` that ``source`` gives, by name, with their tensors' names
    checked: CheckpointError for a missing (unless ``partial``), unexpected or incomplete
    (a stacked parameter needs all its experts) set of names."""
    plan: list[ParamPlan] = []
    expected: set[str] = set()
    present = source.names()
    for path, var in _flat_params(state):
        if not isinstance(var, nnx.Param):  # EPLB placement arrays: not in a checkpoint
            continue
        stacked = is_stacked_experts(path)
        order = placement.physical_order(layer_of(path)) if stacked else None
        names, transpose = hf_sources(path, var, config.num_experts, order, present)
        expected.update(names)
        given = [n for n in names if n in present]
        if partial and not given:
            continue
        if partial and len(given) != len(names):
            missing = sorted(set(names) - present)
            raise CheckpointError(
                f"{source.where}: {len(missing)} tensor(s) of a stacked parameter missing: "
                f"{name_list(missing, 3)}; give all {len(names)} tensors of a layer's "
                "projection together (every expert's; gpt-oss: a fused weight with its bias)"
            )
        plan.append((path, var, names, transpose))
    missing = sorted(expected - present)
    unexpected = sorted(present - expected)
    beyond = mtp_tensor_names(set(unexpected), config.num_hidden_layers)
    if beyond:
        # DeepSeek-V3 and GLM-4.5 ship their multi-token-prediction (MTP) layers as extra
        # decoder layers past num_hidden_layers: the NEXTN draft reads them, if it runs
        # (speculative/nextn.py; weight updates: model_executor/weight_updater.py).
        logger.info("%d tensor(s) of layers past num_hidden_layers=%d (MTP layers) are not "
                    "the main model's", len(beyond), config.num_hidden_layers)
        unexpected = sorted(set(unexpected) - set(beyond))
    where = source.where
    if missing and not partial:
        raise CheckpointError(f"{where}: {len(missing)} tensor(s) missing: "
                              f"{name_list(missing)}")
    if unexpected:
        raise CheckpointError(
            f"{where}: {len(unexpected)} unexpected tensor(s) for {config.architecture}: "
            f"{name_list(unexpected)}"
        )
    return plan


def read_params(
    config: ModelConfig, state: nnx.State, mesh: Mesh, placement: ExpertPlacement,
    source: SafetensorsCheckpoint | ArraySource, partial: bool = False,
) -> dict[Path, jax.Array]:
    """The parameters of ``state`` (abstract or loaded) read from ``source`` by their Hugging
    Face names, converted to each parameter's dtype and placed with its sharding.

    Every tensor is checked before anything is returned, so a bad source changes nothing.
    ``partial``: ``source`` may give a subset (whole parameters: all the experts of a stacked
    one); only those are returned. Otherwise it must give exactly the model's tensors.
    """
    plan = plan_params(config, state, placement, source, partial)
    where = source.where
    pure: dict[Path, jax.Array] = {}
    finite = FiniteCheck(where)
    for path, var, names, transpose in tqdm(plan, desc="Loading weights", unit="tensor",
                                            disable=len(plan) < 2):
        if _fused(var) is not None:
            order = placement.physical_order(layer_of(path))
            pure[path] = _place_fused(var, mesh, names, source, order, config)
        else:
            pure[path] = _place(var, mesh, names, source, transpose, config.architecture)
        finite.add(names, pure[path], stacked=is_stacked_experts(path))  # checked on the devices while the next one is read
    finite.finish()
    logger.info("Read %d tensors from %s", sum(len(p[2]) for p in plan), where)
    return pure


class FiniteCheck:
    """Refuses a NaN or an infinity in a placed parameter (after conversion to its dtype, so a
    float32 value too large for bfloat16 counts too), naming the first such tensor in model
    order and the source.

    Each distinct block of a parameter is checked once, on the device holding its first
    replica, by a single-device program: no collective, so a node whose load fails early can
    never leave another one waiting in a check. In a multi-host job each node therefore judges
    only the blocks it holds (weight_updater agrees the verdicts across nodes). A parameter's
    checks run on the devices while the host reads the next one; their verdict is fetched
    then, so a bad checkpoint fails at the first bad parameter."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.pending: list[tuple[list[str], int, jax.Array]] = []

    def add(self, names: list[str], value: jax.Array, stacked: bool | None = None) -> None:
        """``stacked``: one flag per expert row (default: ``names`` are per expert)."""
        self.finish()
        stacked = _per_expert(names) if stacked is None else stacked
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                first_row = (shard.index[0].start or 0) if stacked else 0
                self.pending.append((names, first_row, finite_flags(shard.data, stacked)))

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for names, first_row, flags in sorted(pending, key=lambda p: p[1]):  # row order
            ok = np.asarray(flags)
            if not ok.all():
                row = first_row + int(np.argmin(ok))
                # Per-expert tensors name the expert; fused ones (gpt-oss) hold all experts.
                bad = names[row] if _per_expert(names) else names[0]
                raise CheckpointError(
                    f"{self.where}: tensor {short_repr(bad, 200)} has non-finite values (NaN "
                    "or infinity, after conversion to the served dtype); weights must be finite")


@functools.partial(jax.jit, static_argnums=1)
def finite_flags(x: jax.Array, per_row: bool) -> jax.Array:
    """One flag per leading row (``per_row``) or one in all: no NaN and no infinity. x * 0 is 0
    for a finite value and NaN otherwise, so a sum of those is exactly 0 iff all are finite
    (it cannot overflow); it runs faster than isfinite().all() on a CPU."""
    zeros = (x * 0).astype(jnp.float32)
    total = zeros.sum(axis=tuple(range(1, x.ndim))) if per_row else zeros.sum()[None]
    return total == 0


def mtp_tensor_names(names: set[str], num_hidden_layers: int) -> list[str]:
    """The names of tensors of layers past ``num_hidden_layers``: a checkpoint's
    multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5), which the main model does
    not read (a NEXTN draft does)."""
    return sorted(n for n in names if isinstance(n, str) and _layer_index(n) >= num_hidden_layers)


def _layer_index(name: str) -> int:
    """The decoder layer of a tensor name ``model.layers.<i>...`` (-1 for other tensors)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1


def check_tensors(var: nnx.Variable, names: list[str],
                  source: SafetensorsCheckpoint | ArraySource, transpose: bool,
                  architecture: str) -> None:
    """CheckpointError unless each of a parameter's tensors is floating point and of the shape
    the parameter needs (one expert's, for a stacked parameter; [out, in] if ``transpose``).
    A parameter built from fused expert tensors (gpt-oss) is refused: its tensors are not a
    cast, transpose or stack of it (the on-device update path converts only those); the host
    path (``read_params``) checks them itself."""
    if _fused(var) is not None:
        raise CheckpointError(
            f"{source.where}: {short_repr(names[0], 200)} is one of {architecture}'s fused "
            "expert tensors, which are converted on the host (interleaved gate/up columns, "
            "biases, MXFP4): update them from disk or as host (numpy) arrays")
    _check_tensors(var, names, source, transpose, architecture)


def _check_tensors(var: nnx.Variable, names: list[str],
                   source: SafetensorsCheckpoint | ArraySource, transpose: bool,
                   architecture: str) -> None:
    target = var.get_value()
    want = tuple(target.shape[1:] if _per_expert(names) else target.shape)
    if transpose:
        want = want[::-1]
    for name in names:
        is_float, dtype = source.is_float(name)
        if not is_float:
            raise CheckpointError(
                f"{source.where}: tensor {short_repr(name, 200)} has dtype {dtype}; weights "
                "must be floating point (float32, bfloat16 or float16)")
        if source.shape(name) != want:
            raise CheckpointError(
                f"{source.where}: tensor {short_repr(name, 200)} has shape "
                f"{short_repr(source.shape(name))}; {architecture} with this config.json "
                f"expects {want}"
            )


def _place(var: nnx.Variable, mesh: Mesh, names: list[str],
           source: SafetensorsCheckpoint | ArraySource, transpose: bool,
           architecture: str) -> jax.Array:
    """One parameter from its tensors: transposed (Hugging Face stores linear weights [out,
    in]), stacked (one tensor per expert, on a leading axis), cast and placed.

    Each device's block is read on its own (``jax.make_array_from_callback``; blocks that
    several devices share are read once), so a host of a multi-host job reads from the files
    only the experts and slices its devices hold. JAX arrays (a weight update from arrays) are
    converted on their devices instead (no host copy)."""
    target = var.get_value()
    stacked = _per_expert(names)
    _check_tensors(var, names, source, transpose, architecture)
    sharding = _param_sharding(var, mesh)
    if isinstance(source, ArraySource) and any(
            isinstance(source.get(n), jax.Array) for n in names):
        arrays = [jnp.asarray(source.get(n)) for n in names]
        arrays = [a.T if transpose else a for a in arrays]
        value = jnp.stack(arrays) if stacked else arrays[0]
        return jax.device_put(value.astype(target.dtype), sharding)

    blocks: dict[tuple, np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            inner = index[1:] if stacked else index
            hf_index = inner[::-1] if transpose else inner

            def piece(name: str) -> np.ndarray:
                part = np.asarray(source.read(name, hf_index))
                return part.T if transpose else part

            if stacked:
                experts = range(*index[0].indices(len(names)))
                value = np.stack([piece(names[e]) for e in experts])
            else:
                value = piece(names[0])
            blocks[key] = value.astype(target.dtype)
        return blocks[key]

    return jax.make_array_from_callback(target.shape, sharding, block)


def _place_fused(var: nnx.Variable, mesh: Mesh, names: list[str],
                 source: SafetensorsCheckpoint | ArraySource, order: Sequence[int],
                 config: ModelConfig) -> jax.Array:
    """A stacked expert parameter built from fused tensors (``fused_experts``), its rows in
    the layer's physical ``order``; each device's block read and converted on its own."""
    target = var.get_value()
    part = _fused(var)[1]
    shapes = fused_experts.expected_shapes(part, names, config.num_experts, config.hidden_size,
                                           config.moe_intermediate_size)
    for name, want in shapes.items():
        is_float, dtype = source.is_float(name)
        quantised = not name.endswith("_bias") and fused_experts.is_mxfp4(names)
        if quantised != (not is_float) or (quantised and dtype not in ("U8", "uint8")):
            kind = "uint8 (MXFP4)" if quantised else "floating point"
            raise CheckpointError(f"{source.where}: tensor {short_repr(name, 200)} has dtype "
                                  f"{dtype}; it must be {kind}")
        if source.shape(name) != want:
            raise CheckpointError(
                f"{source.where}: tensor {short_repr(name, 200)} has shape "
                f"{short_repr(source.shape(name))}; {config.architecture} with this "
                f"config.json expects {want}")

    def read(name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(source.read(name, index))

    blocks: dict[tuple, np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in blocks:
            rows = range(*index[0].indices(len(order)))
            value = np.stack([fused_experts.expert_block(read, names, part, order[r])[index[1:]]
                              for r in rows])
            blocks[key] = value.astype(target.dtype)
        return blocks[key]

    return jax.make_array_from_callback(target.shape, _param_sharding(var, mesh), block)
