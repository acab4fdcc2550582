"""Release and resume of a runner's device memory (SGLang's ``release_memory_occupation``).

A released tag's device arrays are deleted and replaced, in the runner, by
``jax.ShapeDtypeStruct`` placeholders that keep each array's shape, dtype and sharding: a
step given them fails at once instead of reading freed memory (the scheduler takes no request
meanwhile). Resume builds arrays of exactly those shapes, dtypes and shardings, so every
compiled step is reused as it is (no recompilation).

- "kv_cache": nothing is kept (the scheduler flushes the prefix cache first); resume makes
  zeroed caches, as at start-up, in one jitted call (compiled once per runner).
- "weights": the contents go to host memory first, one numpy copy per distinct shard of each
  array (replicas are kept once; on a multi-host job each node keeps its own shards), and
  resume puts every shard back on its devices: the weights come back bit for bit.

The host copies are explicit copies: on the CPU backend a numpy view of a device array can
share its buffer, and then deleting the array would free nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# A shard's place in its array: its index (a tuple of slices) as a hashable key.
ShardKey = tuple[tuple[Any, Any, Any], ...]


def live_device_bytes() -> int:
    """Bytes of the device buffers of this process's live JAX arrays (``jax.live_arrays()``),
    each buffer once: JAX may hold two array objects over one buffer (the loaded parameters
    are), and a plain sum of ``nbytes`` would count it twice. A replicated array counts once
    per device that holds it."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += shard.data.nbytes
    return total


def measured(change: Callable[[], None]) -> dict[str, Any]:
    """Runs ``change`` and returns this process's live device bytes before and after it, and
    the seconds it took (its device work finished)."""
    before, t0 = live_device_bytes(), time.perf_counter()
    change()
    for a in jax.live_arrays():
        a.block_until_ready()
    return {"device_bytes_before": before, "device_bytes_after": live_device_bytes(),
            "seconds": time.perf_counter() - t0}


def _key(index: tuple[slice, ...]) -> ShardKey:
    return tuple((s.start, s.stop, s.step) for s in index)


def _to_host(a: jax.Array) -> dict[ShardKey, np.ndarray]:
    """A copy of every distinct shard this process holds, by its place in the array."""
    host: dict[ShardKey, np.ndarray] = {}
    for shard in a.addressable_shards:
        key = _key(shard.index)
        if key not in host:
            host[key] = np.array(shard.data, copy=True)
    return host


def _to_device(host: dict[ShardKey, np.ndarray], spec: jax.ShapeDtypeStruct) -> jax.Array:
    """The array ``_to_host`` copied, rebuilt shard by shard with its sharding."""
    places = spec.sharding.addressable_devices_indices_map(spec.shape)
    shards = [jax.device_put(host[_key(index)], device) for device, index in places.items()]
    return jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, shards)


@dataclass
class _Released:
    specs: list[jax.ShapeDtypeStruct]  # shape, dtype and sharding of each array
    host: list[dict[ShardKey, np.ndarray]] | None  # kept contents; None: zeros on resume


class MemoryOccupation:
    """What a runner has released, by tag, and how to put it back."""

    def __init__(self) -> None:
        self._released: dict[str, _Released] = {}
        self._zeros: dict[str, Callable[[], list[jax.Array]]] = {}

    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    def release(self, tag: str, arrays: list[jax.Array], keep: bool) -> list[Any]:
        """Deletes ``arrays`` (their contents copied to host memory first if ``keep``);
        returns their placeholders."""
        if tag in self._released:
            raise ValueError(f"{tag} is released already")
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays]
        host = [_to_host(a) for a in arrays] if keep else None
        for a in arrays:
            a.delete()  # freed now, even if a reference were left somewhere
        self._released[tag] = _Released(specs, host)
        return specs

    def resume(self, tag: str) -> list[jax.Array]:
        """New arrays for the placeholders of ``tag``: its kept contents, or zeros."""
        released = self._released.get(tag)
        if released is None:
            raise ValueError(f"{tag} is not released")
        # The tag stays released (its host copy kept) until every array exists: a resume that
        # fails, say out of device memory while the trainer still holds its own, can be retried.
        made: list[jax.Array] = []
        try:
            if released.host is not None:
                for host, spec in zip(released.host, released.specs, strict=True):
                    made.append(_to_device(host, spec))
            else:
                if tag not in self._zeros:
                    specs = released.specs
                    self._zeros[tag] = jax.jit(
                        lambda: [jnp.zeros(s.shape, s.dtype) for s in specs],
                        out_shardings=[s.sharding for s in specs])
                made = self._zeros[tag]()
        except BaseException:
            for a in made:
                a.delete()
            raise
        del self._released[tag]
        return made
