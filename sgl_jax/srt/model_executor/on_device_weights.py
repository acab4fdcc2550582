"""A weight update from JAX arrays of this process, done on the devices (single-process mode).

The arrays (Hugging Face names, ``ArraySource``) are checked as the loader checks a checkpoint
(names, shapes, float dtypes: ``plan_params`` / ``check_tensors``), then their values: every
tensor must be finite after conversion to its parameter's dtype. That check is a jitted
reduction per parameter (one flag per tensor, kept on the devices) and one more over all the
flags: the only bytes that reach the host are that last verdict (one bool; on a failure also
the flags, to name the first bad tensor). Nothing is converted before every check passed.

Then each parameter is made on the devices by one jitted program (transpose from Hugging
Face's [out, in], stack the experts in the placement's physical order, cast) whose
``out_shardings`` is the served parameter's sharding, and replaces it at once: the old array is
deleted as soon as its successor exists. So the device memory of the update is the served
parameters plus the one being made (at most the largest stacked tensor), not a second copy of
the model. The conversion runs under a transfer guard that refuses any host transfer, implicit
or explicit: the update moves no byte through host memory, or fails saying so.

All-or-nothing: every check runs before the first parameter changes; what could still fail
after (the devices running out of memory) leaves each parameter either old or new, all valid,
and the error says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax.srt.bounded_text import short_repr
from sgl_jax.srt.model_executor.memory_occupation import live_device_bytes
from sgl_jax.srt.model_loader.loader import (
    ArraySource,
    CheckpointError,
    check_tensors,
    finite_flags,
    is_stacked_experts,
    plan_params,
)
from sgl_jax.srt.model_loader.qwen35_names import family_source


@dataclass
class _Param:
    var: nnx.Variable  # the served parameter's variable (in the runner's state)
    names: list[str]  # its Hugging Face tensors (stacked: in physical order)
    transpose: bool
    stacked: bool  # one tensor per expert, stacked in physical order
    sources: list[jax.Array]  # the given arrays
    on_mesh: bool  # all on the engine's devices, in its order (else moved there first)

    @property
    def nbytes(self) -> int:
        return self.var.get_value().nbytes


@contextmanager
def no_host_transfers() -> Iterator[None]:
    """Any transfer between host and devices in this thread raises, explicit ones too."""
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
            jax.transfer_guard_device_to_host("disallow_explicit"):
        yield


class OnDeviceUpdate:
    """One update of ``runner``'s parameters from ``arrays`` (HF name -> ``jax.Array``).

    ``check()`` (no change; WeightUpdateError-able ValueErrors), then ``apply()``. After
    ``apply``: ``count`` parameters replaced, ``host_bytes`` moved between host and devices,
    and with ``measure_memory`` ``peak_device_bytes`` (this process's live device bytes when
    the largest new parameter and the one it replaces both existed: the update's point of
    maximal residency)."""

    def __init__(self, runner: Any, arrays: dict[str, jax.Array],
                 measure_memory: bool = False) -> None:
        self.runner = runner
        self.measure_memory = measure_memory  # costs a scan of every live array
        self.source: Any = ArraySource(arrays)  # (mapped for the family in ``check``)
        self.state = jax.tree.unflatten(runner.param_treedef, runner.param_leaves)
        self.params: list[_Param] = []
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self.count = 0

    def check(self) -> None:
        runner = self.runner
        cfg = runner.model_config
        self.source = family_source(cfg, self.source, updating=True)
        plan = plan_params(cfg, self.state, runner.expert_placement, self.source, partial=True)
        with no_host_transfers():
            for path, var, names, transpose in plan:
                check_tensors(var, names, self.source, transpose, cfg.architecture)
                sources = [self.source.get(n) for n in names]
                on_mesh = all(_on_mesh(s, runner.mesh) for s in {a.sharding for a in sources})
                self.params.append(_Param(var, names, transpose, is_stacked_experts(path),
                                          sources, on_mesh))
            flags = [_finite_flags(p, runner.mesh) for p in self.params]
            verdict = _all_true(flags) if flags else None
        if verdict is None:
            return
        ok = np.asarray(jax.device_get(verdict))  # the one host transfer: a bool
        self.host_bytes += ok.nbytes
        if not ok:
            self._name_non_finite(flags)

    def _name_non_finite(self, flags: list[jax.Array]) -> None:
        for param, f in zip(self.params, flags, strict=True):
            row = np.asarray(jax.device_get(f))
            self.host_bytes += row.nbytes
            if not row.all():
                bad = param.names[int(np.argmin(row))]
                raise CheckpointError(
                    f"{self.source.where}: tensor {short_repr(bad, 200)} has non-finite values "
                    "(NaN or infinity, after conversion to the served dtype); weights must be "
                    "finite")
        raise AssertionError("the verdict and the flags disagree")  # pragma: no cover

    def apply(self) -> None:
        """Makes and swaps in each parameter in turn; the runner's leaves are set at the end
        (also on a failure part-way: then each parameter is old or new, all valid)."""
        largest = max(self.params, key=lambda p: p.nbytes, default=None)
        try:
            with no_host_transfers():
                for param in self.params:
                    old = param.var.get_value()
                    sources = param.sources if param.on_mesh else [
                        _onto_mesh(a, old.sharding, param.transpose, param.stacked)
                        for a in param.sources]
                    new = _converter(param.transpose, param.stacked, jnp.dtype(old.dtype),
                                     old.sharding)(sources)
                    del sources
                    if (new.shape, new.dtype, new.sharding) != (old.shape, old.dtype,
                                                                 old.sharding):
                        raise RuntimeError("a converted parameter differs in layout from the "
                                           "compiled one")
                    if param is largest and self.measure_memory:
                        new.block_until_ready()
                        self.peak_device_bytes = live_device_bytes()
                    param.var.set_value(new)
                    old.delete()  # freed now: the engine holds one copy of each parameter
                    self.count += 1
        except Exception as e:
            self.runner.param_leaves = jax.tree.leaves(self.state)
            if self.count:
                raise RuntimeError(
                    f"the update stopped after {self.count} of {len(self.params)} parameters "
                    f"({type(e).__name__}); those are new, the others old: update again") from e
            raise
        self.runner.param_leaves = jax.tree.leaves(self.state)
        jax.block_until_ready(self.runner.param_leaves)


def _on_mesh(sharding: jax.sharding.Sharding, mesh: Mesh) -> bool:
    """Whether arrays of ``sharding`` live on the engine's devices in the mesh's order (what
    one jitted program over them and the engine's parameters needs)."""
    devices = list(mesh.devices.flat)
    if len(devices) == 1:
        return sharding.device_set == set(devices)
    return isinstance(sharding, NamedSharding) and list(sharding.mesh.devices.flat) == devices


def _onto_mesh(a: jax.Array, target: NamedSharding, transpose: bool,
               stacked: bool) -> jax.Array:
    """``a`` itself if it is on the engine's devices; else a device-to-device copy laid out as
    its part of the ``target`` parameter (a stacked one: each expert's tensor replicated over
    the expert axis). Only then does an update need more than the memory bound of the
    module's docstring: the copies of one parameter's tensors."""
    if _on_mesh(a.sharding, target.mesh):
        return a
    spec = tuple(target.spec) + (None,) * (a.ndim + stacked - len(target.spec))
    spec = spec[1:] if stacked else spec
    return jax.device_put(a, NamedSharding(target.mesh, PartitionSpec(*(
        spec[::-1] if transpose else spec))))


@functools.partial(jax.jit, static_argnums=1)
def _finite_flags_jit(arrays: list[jax.Array], dtype: Any) -> jax.Array:
    # The loader's check of each tensor, after the cast (fused into the reduction by XLA: the
    # cast values are never stored).
    return jnp.concatenate([finite_flags(a.astype(dtype), False) for a in arrays])


def _finite_flags(param: _Param, mesh: Mesh) -> jax.Array:
    """One flag per tensor of ``param``, on the engine's devices: finite after the cast to
    the parameter's dtype. One program for all when they are on the engine's devices; else
    one per tensor, on its own devices, its flag then copied over (device to device)."""
    dtype = jnp.dtype(param.var.get_value().dtype)
    if param.on_mesh:
        return _finite_flags_jit(param.sources, dtype)
    replicated = NamedSharding(mesh, PartitionSpec())
    return jnp.concatenate([jax.device_put(_finite_flags_jit([a], dtype), replicated)
                            for a in param.sources])


@jax.jit
def _all_true(flags: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.concatenate(flags))


@functools.cache
def _converter(transpose: bool, stacked: bool, dtype: Any,
               sharding: NamedSharding) -> Callable[[list[jax.Array]], jax.Array]:
    def convert(arrays: list[jax.Array]) -> jax.Array:
        parts = [a.T if transpose else a for a in arrays]
        value = jnp.stack(parts) if stacked else parts[0]
        # A copy even when nothing changes: the result must never be the caller's buffer
        # (jit forwards an unchanged input as is), which the trainer may donate or delete.
        return jnp.array(value.astype(dtype), copy=True)
    return jax.jit(convert, out_shardings=sharding)

