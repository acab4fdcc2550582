"""Run Pallas TPU kernels (ragged paged attention) on CPU in TPU interpret mode: tests only.

Written against JAX 0.10.2's interpreter internals (CPU only); ``tests/test_backends.py``
runs the kernel through it on every CI run, so a JAX upgrade that changes them fails loudly.

Problem
-------
JAX's TPU interpret mode (``pltpu.force_tpu_interpret_mode()``) turns every
ref read/write inside the kernel into a host callback
(``jax._src.pallas.mosaic.interpret.interpret_pallas_call.get`` / ``swap``).
Those callbacks convert the ref's transform stack into a single numpy index
with ``interpret_utils.to_range``, which only understands ``NDIndexer``
transforms (``ref.at[...]`` / ``ref[...]``).  The ragged paged attention
kernel does

    kv_ref = cur_async_copy_kv.wait().reshape(N, head_dim)   # ReshapeTransform
    k = kv_ref[start::step, :]                                # NDIndexer

so the transform stack is ``(NDIndexer[buf_idx], Reshape(N, D), NDIndexer[start::step, :])``
and ``to_range`` crashes with ``'ReshapeTransform' object has no attribute 'indices'``.
(For bf16/int8 KV caches the kernel additionally uses ``ref.bitcast(uint32)``,
i.e. a ``BitcastTransform``, which has the same problem.)

Patch
-----
``enable_tpu_interpret_mode()`` wraps the two module-level host callbacks ``get`` and
``swap`` of ``jax._src.pallas.mosaic.interpret.interpret_pallas_call``
(the interpreter looks them up as module globals each time it traces a
load/get/swap equation, so replacing the attribute is sufficient).  When the
transform stack contains a non-indexer transform (Reshape / Bitcast), the
wrapper

    1. splits the stack at the first non-indexer transform:
     ``prefix = leading NDIndexers`` , ``suffix = the rest``;
    2. calls the ORIGINAL callback with only ``prefix``; this reads exactly the
     (sub)buffer that the reshape/bitcast was applied to, with all of the
     interpreter's bookkeeping (bounds checks, vector clocks, race detection,
     uninitialized-value handling) applied to that region;
    3. applies ``suffix`` on the host with numpy: Reshape -> row-major
     ``np.reshape`` (the semantics of ``state.types.ReshapeTransform``, which
     only changes the logical shape of the viewed array), Bitcast -> same
     packing convention as ``jax._src.state.utils.bitcast`` (packs consecutive
     rows of the second-minor dim, little-endian), NDIndexer -> basic numpy
     indexing (ints + strided slices; the interpreter rejects gathers anyway).

For ``swap`` (a store through a reshaped/bitcast ref) it does a
read-modify-write of the prefix region: read it with the original ``get``,
build the suffix view of a numpy copy (all steps are numpy *views* so writes
propagate), write the (masked) value, and store the whole prefix region back
with the original ``swap``.  Reads/stores without reshape/bitcast go straight
to the original functions, so behaviour for every other kernel is unchanged.

Under ``shard_map`` on several CPU devices a third problem appears: JAX's ``io_callback``
implementation ``device_put``s the callback's arguments onto CPU device 0 and waits for them,
while device 0 may itself be blocked in a callback of the same program (the interpreter
synchronises devices with barriers): a deadlock. ``enable_tpu_interpret_mode`` therefore also
hands the callbacks XLA's host (numpy) arguments directly.

Only for tests / CPU interpret mode: it changes the process for good.
"""

from __future__ import annotations

import functools
import types

import jax
import numpy as np
from jax._src import callback as _jax_callback
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax._src.pallas.mosaic.interpret import params as _ip_params
from jax._src.pallas.mosaic.interpret import shared_memory as _shm
from jax._src.pallas.mosaic.interpret import vector_clock as _vc
from jax._src.state import indexing as _indexing
from jax._src.state import types as _state_types

__all__ = ["enable_tpu_interpret_mode"]


# ----------------------------------------------------------------------------
# Host-side (numpy) application of ref transforms.
# ----------------------------------------------------------------------------
def _is_indexer(t) -> bool:
    return isinstance(t, _indexing.NDIndexer)


def _needs_patch(transforms) -> bool:
    return transforms is not None and any(not _is_indexer(t) for t in transforms)


def _split(transforms):
    transforms = tuple(transforms)
    k = next(i for i, t in enumerate(transforms) if not _is_indexer(t))
    return transforms[:k], transforms[k:]


def _np_index(indexer: _indexing.NDIndexer):
    idx = []
    for i in indexer.indices:
        if isinstance(i, _indexing.Slice):
            start, size, stride = int(i.start), int(i.size), int(i.stride)
            idx.append(slice(start, start + size * stride, stride))
        else:
            i = np.asarray(i)
            if i.ndim != 0:
                raise NotImplementedError("gather-style indexers are not supported")
            idx.append(int(i))
    return tuple(idx)


def _np_bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """numpy port of jax._src.state.utils.bitcast (TPU ref bitcast semantics)."""
    dtype = np.dtype(dtype)
    src_bits, dst_bits = x.dtype.itemsize * 8, dtype.itemsize * 8
    if src_bits == dst_bits:
        return x.view(dtype)
    *lead, m, n = x.shape
    if src_bits < dst_bits:
        r = dst_bits // src_bits
        y = np.ascontiguousarray(x.reshape(*lead, m // r, r, n).swapaxes(-1, -2))
        return y.view(dtype).reshape(*lead, m // r, n)
    r = src_bits // dst_bits
    y = np.ascontiguousarray(x).view(dtype).reshape(*lead, m, n, r)
    return np.ascontiguousarray(y.swapaxes(-1, -2)).reshape(*lead, m * r, n)


def _apply(x: np.ndarray, transforms, *, need_view: bool = False) -> np.ndarray:
    for t in transforms:
        if _is_indexer(t):
            x = x[_np_index(t)]
        elif isinstance(t, _state_types.ReshapeTransform):
            y = x.reshape(t.shape)  # row-major, like the logical ref reshape
            if need_view and y.size and not np.shares_memory(y, x):
                # numpy had to copy; writes through `y` would be lost.
                raise NotImplementedError("store through reshape of a strided view")
            x = y
        elif isinstance(t, _state_types.BitcastTransform):
            if need_view:
                raise NotImplementedError("store through a bitcast ref")
            x = _np_bitcast(x, t.dtype)
        else:
            raise NotImplementedError(f"unsupported ref transform {type(t).__name__}")
    return x


# ----------------------------------------------------------------------------
# Wrappers around the interpreter's host callbacks.
# ----------------------------------------------------------------------------
def _make_get(orig_get):
    @_ipc.fail_on_exception
    @functools.wraps(orig_get)
    def get(token, device_id, local_core_id, memory_space, buffer_id,
            transforms, *args, **kwargs):
        if not _needs_patch(transforms):
            return orig_get(token, device_id, local_core_id, memory_space,
                    buffer_id, transforms, *args, **kwargs)
        prefix, suffix = _split(transforms)
        token, base = orig_get(token, device_id, local_core_id, memory_space,
                buffer_id, prefix, *args, **kwargs)
        suffix = jax.tree.map(int, suffix)
        return token, np.ascontiguousarray(_apply(np.asarray(base), suffix))
    return get


def _make_swap(orig_get, orig_swap):
    @_ipc.fail_on_exception
    @functools.wraps(orig_swap)
    def swap(token, device_id, local_core_id, memory_space, buffer_id,
            transforms, val, mask, *args, **kwargs):
        if mask is not None:
            _fix_masked_swap(_ipc._get_shared_memory())
        if not _needs_patch(transforms):
            return orig_swap(token, device_id, local_core_id, memory_space,
                    buffer_id, transforms, val, mask, *args, **kwargs)
        prefix, suffix = _split(transforms)
        source_info = kwargs.get("source_info")
        token, base = orig_get(token, device_id, local_core_id, memory_space,
                buffer_id, prefix, source_info=source_info)
        base = np.array(base, copy=True)  # contiguous copy -> reshapes are views
        suffix = jax.tree.map(int, suffix)
        view = _apply(base, suffix, need_view=True)
        old = view.copy()
        val = np.asarray(val)
        if mask is None:
            view[...] = val
        else:
            mask = np.asarray(mask)
            view[...] = np.where(mask, val, view)
        token, _ = orig_swap(token, device_id, local_core_id, memory_space,
                buffer_id, prefix, base, None, *args, **kwargs)
        return token, old
    return swap


# ----------------------------------------------------------------------------
# Fix for masked stores (pl.store(..., mask=...)) in SharedMemory.
# ----------------------------------------------------------------------------
def _fix_masked_swap(shared_memory):
    """Installs the fixed swap_buffer_content on this SharedMemory *instance*
    (a fresh one is created per interpreted kernel run), not on the class."""
    if "swap_buffer_content" not in vars(shared_memory):
        fixed = _make_swap_buffer_content(_shm.SharedMemory.swap_buffer_content)
        shared_memory.swap_buffer_content = types.MethodType(fixed, shared_memory)


def _make_swap_buffer_content(orig):
    # JAX 0.10.2's masked branch builds its "in bounds" mask with
    #   in_bounds_mask[in_bounds_shape[i]:] = False      # for every axis i
    # which always indexes axis 0, so e.g. a fully in-bounds masked store of
    # shape (8, 2, 128) is reported as out of bounds as soon as the mask is True
    # in any row >= 2.  This re-implements only the masked branch with the
    # per-axis check; everything else (locking, vector clocks, clipping to the
    # logical shape, return values) mirrors the original.
    @functools.wraps(orig)
    def swap_buffer_content(self, key, rnge, value, mask, global_core_id,
            increment_clock=True, logging_info=None):
        if mask is None:
            return orig(self, key, rnge, value, mask, global_core_id,
                    increment_clock=increment_clock, logging_info=logging_info)
        clock = None
        with self.lock:
            if self.detect_races and increment_clock:
                _vc.inc_vector_clock(self.clocks[global_core_id], global_core_id)
                clock = _vc.copy_vector_clock(self.clocks[global_core_id])
            buff = self.mem[key]
            if not isinstance(buff, _shm.Buffer):
                raise ValueError(f"Attempting to swap into non-Buffer allocation {key}.")
            shape_and_dtype = _shm.ShapeAndDtype(buff.logical_shape, buff.dtype)
            assert buff.dtype == value.dtype
            try:
                raw = buff[rnge].copy()
            except IndexError:  # entirely out of bounds
                raw = None
            result = None
            if raw is not None:
                in_idx = tuple(slice(s) for s in raw.shape)
                out_of_bounds = np.ones(mask.shape, dtype=bool)
                out_of_bounds[in_idx] = False
                if not (out_of_bounds & mask).any():
                    m = mask[in_idx]
                    result = value.copy()
                    result[in_idx] = np.where(m, raw, value[in_idx])
                    buff.set_in_bounds_portion(rnge, np.where(m, value[in_idx], raw))
        return result, shape_and_dtype, clock
    return swap_buffer_content


_enabled = False


def enable_tpu_interpret_mode() -> None:
    """Turns the patched TPU interpret mode on for the rest of this process (idempotent).

    A jitted step traces the kernel in one place but lowers it (where the interpreter's host
    callbacks are bound) later, outside any ``with`` block around the call; so a CPU process
    that serves the Pallas backend enables it once, for every compilation.
    """
    global _enabled
    if _enabled:
        return
    _ipc.swap = _make_swap(_ipc.get, _ipc.swap)
    _ipc.get = _make_get(_ipc.get)
    _ipc.set_tpu_interpret_mode(_ip_params.InterpretParams())
    _jax_callback.io_callback_impl = _host_io_callback_impl
    _enabled = True


def _host_io_callback_impl(*args, result_avals, callback, sharding, ordered):
    """``io_callback`` whose host function gets the numpy arrays XLA handed over.

    JAX's own implementation first ``device_put``s them onto CPU device 0. Under ``shard_map``
    on several (fake) CPU devices that transfer waits for device 0's stream, which is busy
    running the very program whose other device is blocked in its own callback (or at the
    interpreter's cross-device barrier): a deadlock. The interpreter's callbacks only read
    their arguments with numpy, so no device array is needed.
    """
    del result_avals, sharding, ordered
    return jax.tree.map(np.asarray, callback(*args))
