"""The typed wire codec of the step channel: what rank 0 sends its followers, as MessagePack.

Nothing that arrives from another host is unpickled (docs/security.md): a pickle runs whatever
code its bytes name. This codec writes exactly the values the channel carries and reads back
only those:

- MessagePack's own types: None, bool, int, float, str, bytes, list, dict (str keys);
- tuples (``prefix_pages`` rows are ``(slot, pages)``);
- numpy arrays of an allow-listed numeric dtype, as (dtype name, shape, raw little-endian
  bytes): never ``object`` dtype, and the byte count must match the shape;
- the dataclasses in ``_DATACLASSES`` (the step's ``ModelWorkerBatch`` and what it holds, and
  the control operations every node applies: ``control.py``, ``mirrored``), by
  name into their constructor with exactly their fields' values (in declaration order; the
  start-up fingerprint holds ``schema()``, so nodes whose fields differ never join), and the
  enums in ``_ENUMS``.

Numpy scalars are written as the Python number of equal value. Anything else is refused when
encoding (a ``ValueError`` on rank 0, naming the type), and a message that is not what this
module writes is refused when decoding with a ``ValueError``: unknown type names, a dtype off
the list, a size that does not match the shape, truncated or trailing bytes.

Decoding happens only after the message's MAC verified (``node_auth``): the codec is the
second line of defence, not the first.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import struct
from collections.abc import Callable
from typing import Any

import ml_dtypes
import msgpack
import numpy as np

from sgl_jax.srt.forward_batch_info import ForwardMode, LogprobRequest, ModelWorkerBatch
from sgl_jax.srt.managers.control import (
    RebalanceExperts,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    StartExpertRecord,
    StopExpertRecord,
    UpdateWeightsFromArrays,
    UpdateWeightsFromDisk,
)
from sgl_jax.srt.sampling.sampling_params import SamplingParams

# MessagePack extension codes.
_EXT_NDARRAY = 1
_EXT_TUPLE = 2
_EXT_DATACLASS = 3
_EXT_ENUM = 4
_EXT_OBJECTS = 5  # a list of objects of one dataclass type, by column

# The numeric dtypes an array may have, by numpy name (bfloat16 / float8: ml_dtypes, what
# weight updates of a bf16 or fp8 checkpoint carry). Never object, string or void dtypes.
_DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t) for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
}
_MAX_NDIM = 32

# The types a message may hold, by name: decoded into their constructor, nothing else. The
# control operations are those that change device state on every node (``mirrored``).
_DATACLASSES: dict[str, type] = {
    cls.__name__: cls for cls in (
        ModelWorkerBatch, SamplingParams, LogprobRequest, UpdateWeightsFromDisk,
        UpdateWeightsFromArrays, RebalanceExperts, StartExpertRecord, StopExpertRecord,
        ReleaseMemoryOccupation, ResumeMemoryOccupation)
}
# Their fields in declaration order: an object goes as its values in that order (a step holds
# one SamplingParams per request; names and ``dataclasses.fields`` per object cost 10x more).
# Both ends must have the same fields: ``schema()`` is in the nodes' start-up fingerprint.
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _DATACLASSES.values()
}
assert all(f.init for cls in _DATACLASSES.values() for f in dataclasses.fields(cls))


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    """The values of ``names`` of an object, as a tuple (attrgetter gives one for two or more
    names only)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    return lambda obj: tuple(getattr(obj, name) for name in names)


_GETTERS = {cls: _getter(names) for cls, names in _FIELDS.items()}


def schema() -> str:
    """The types this codec carries and their fields: equal on every node of a job."""
    return "; ".join(f"{cls.__name__}({', '.join(_FIELDS[cls])})" for cls in _FIELDS)
_ENUMS: dict[str, type[enum.Enum]] = {cls.__name__: cls for cls in (ForwardMode,)}


# -- encoding ------------------------------------------------------------------------------------
def encode(obj: Any) -> bytes:
    """``obj`` as MessagePack bytes; ValueError if it holds a type this codec does not carry."""
    try:
        return _pack(obj)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"cannot send this over the step channel: {e}") from e


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _default(obj: Any) -> Any:
    """What strict MessagePack does not write itself (strict: subclasses come here too, so an
    IntEnum is not silently written as a bare int, nor a tuple as a list)."""
    if isinstance(obj, np.ndarray):
        return msgpack.ExtType(_EXT_NDARRAY, _array_bytes(obj))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    if isinstance(obj, enum.Enum):
        name = type(obj).__name__
        if _ENUMS.get(name) is not type(obj):
            raise TypeError(f"enum {name} is not on the step channel's list")
        return msgpack.ExtType(_EXT_ENUM, _pack([name, obj.value]))
    getter = _GETTERS.get(type(obj))
    if getter is not None:
        values = [_by_column(v) for v in getter(obj)]
        return msgpack.ExtType(_EXT_DATACLASS, _pack([type(obj).__name__, values]))
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (np.floating, float)):  # np.float64 is a float subclass
        return float(obj)
    if isinstance(obj, int):  # an int subclass that is no enum
        return int(obj)
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"type {type(obj).__module__}.{type(obj).__qualname__} is not on the step "
                    "channel's list")


def _by_column(value: Any) -> Any:
    """A field's value; a list of objects of one listed type goes column by column (a step's
    per-request SamplingParams: one ext and one packing for all, not one per request)."""
    if type(value) is not list or not value:
        return value
    cls = type(value[0])
    getter = _GETTERS.get(cls)
    if getter is None or any(type(v) is not cls for v in value):
        return value
    columns = [list(column) for column in zip(*map(getter, value), strict=True)]
    return msgpack.ExtType(_EXT_OBJECTS, _pack([cls.__name__, columns]))


def _array_bytes(a: np.ndarray) -> bytes:
    """Header (dtype name, ndim, shape as uint64) then the raw little-endian bytes."""
    name = a.dtype.name
    if _DTYPES.get(name) is None or a.dtype.kind not in "biufV" or a.dtype.hasobject:
        raise TypeError(f"arrays of dtype {a.dtype} do not go over the step channel")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.ndim > _MAX_NDIM:
        raise TypeError(f"arrays of {a.ndim} dimensions do not go over the step channel")
    header = struct.pack(f"<B{len(name)}sB{a.ndim}Q", len(name), name.encode(), a.ndim,
                         *a.shape)
    return header + np.ascontiguousarray(a).tobytes()


# -- decoding ------------------------------------------------------------------------------------
def decode(data: bytes) -> Any:
    """The value ``encode`` wrote; ValueError for anything else."""
    try:
        return _unpack(data)
    except _Refused:
        raise
    except Exception as e:  # msgpack's own errors (truncated, extra data, bad keys, depth)
        raise ValueError(f"malformed step channel message: {type(e).__name__}: {e}") from e


class _Refused(ValueError):
    """What this module says is wrong with a message (passed on as it is)."""


def _unpack(data: bytes) -> Any:
    # raw=False: strings are UTF-8; strict_map_key: dict keys are str or bytes only.
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True,
                           use_list=True)



def _dataclass_named(name: Any) -> type:
    """The allowed dataclass a message names; refused for any other name."""
    cls = _DATACLASSES.get(name)
    if cls is None:
        raise _Refused(f"step channel message names unknown type {name!r}; it carries "
                       f"only {', '.join(sorted(_DATACLASSES))}")
    return cls

def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY:
        return _array_from(data)
    if code == _EXT_TUPLE:
        items = _unpack(data)
        if not isinstance(items, list):
            raise _Refused("malformed step channel message: a tuple that is not a list")
        return tuple(items)
    if code == _EXT_ENUM:
        name, value = _pair(_unpack(data), "enum")
        cls = _ENUMS.get(name)
        if cls is None:
            raise _Refused(f"step channel message names unknown enum {name!r}")
        try:
            return cls(value)
        except ValueError as e:
            raise _Refused(f"step channel message: {e}") from e
    if code == _EXT_DATACLASS:
        name, values = _pair(_unpack(data), "object")
        cls = _dataclass_named(name)
        if not isinstance(values, list) or len(values) != len(_FIELDS[cls]):
            count = len(values) if isinstance(values, list) else "no list of"
            raise _Refused(
                f"step channel message: a {name} of {count} values, expected its "
                f"{len(_FIELDS[cls])} fields ({', '.join(_FIELDS[cls])})")
        return cls(*values)
    if code == _EXT_OBJECTS:
        name, columns = _pair(_unpack(data), "objects")
        cls = _dataclass_named(name)
        width = len(_FIELDS[cls])
        if not (isinstance(columns, list) and len(columns) == width
                and all(isinstance(c, list) and len(c) == len(columns[0]) for c in columns)):
            raise _Refused(f"step channel message: {name} objects that are not {width} "
                           f"columns of equal length ({', '.join(_FIELDS[cls])})")
        return [cls(*row) for row in zip(*columns, strict=True)]
    raise _Refused(f"step channel message holds unknown extension type {code}")


def _pair(value: Any, what: str) -> tuple[str, Any]:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise _Refused(f"malformed step channel message: a bad {what} header")
    return value[0], value[1]


def _array_from(data: bytes) -> np.ndarray:
    """A fresh, writable array from ``_array_bytes``'s layout, every size checked first."""
    view = memoryview(data)
    if len(view) < 1:
        raise _Refused("step channel array: truncated header")
    name_len = view[0]
    if len(view) < 2 + name_len:
        raise _Refused("step channel array: truncated header")
    name = bytes(view[1 : 1 + name_len]).decode("ascii", errors="replace")
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise _Refused(f"step channel array of dtype {name!r}; allowed: "
                         f"{', '.join(_DTYPES)}")
    ndim = view[1 + name_len]
    start = 2 + name_len + 8 * ndim
    if ndim > _MAX_NDIM or len(view) < start:
        raise _Refused(f"step channel array: bad or truncated shape ({ndim} dimensions)")
    shape = struct.unpack_from(f"<{ndim}Q", view, 2 + name_len)
    nbytes = math.prod(shape) * dtype.itemsize
    if len(view) - start != nbytes:
        raise _Refused(f"step channel array of shape {tuple(shape)} and dtype {name} needs "
                         f"{nbytes} bytes, got {len(view) - start}")
    out = np.empty(shape, dtype)
    out.reshape(-1).view(np.uint8)[:] = np.frombuffer(view, np.uint8, nbytes, start)
    return out
