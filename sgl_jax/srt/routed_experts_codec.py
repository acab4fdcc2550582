"""The wire format of routed experts, for the detokenizer and for clients: numpy and base64 only.

This module must not import JAX (nor anything that does): the detokenizer process and client
programs decode routed experts without loading JAX (tested in a fresh interpreter).

Wire format: the ids of rows ``[n, num_hidden_layers, num_experts_per_tok]`` as little-endian
integers of the request's ``routed_experts_dtype`` (``int32`` by default, or ``int16``,
``uint16``, ``uint8``), raw bytes, standard base64, in ``meta_info["routed_experts"]`` (Engine
and ``/generate``) or ``choices[i].meta_info.routed_experts`` (OpenAI routes), described by
``meta_info["routed_experts_dtype"]`` and ``meta_info["routed_experts_shape"]`` (``[n, layers,
k]``). A layer without a router holds -1 in the signed dtypes and the dtype's maximum (255,
65535) in the unsigned ones. The routing weights of the same rows (when asked for) travel the
same way as ``float32`` or ``float16`` in ``meta_info["routed_expert_weights"]``.

The same keys hold the same bytes unencoded in a MessagePack response (``Accept:
application/msgpack``), and numpy arrays with ``Engine.generate(routed_experts_format="numpy")``;
the ``extract_*`` functions take every form.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pybase64

# The wire dtypes of routed-experts ids, by name: little-endian whatever the host.
ROUTED_EXPERTS_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "uint8": np.dtype("u1"),
}
DEFAULT_DTYPE = "int32"
WIRE_DTYPE = ROUTED_EXPERTS_DTYPES[DEFAULT_DTYPE]


def wire_dtype(name: str) -> np.dtype:
    try:
        return ROUTED_EXPERTS_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"routed_experts_dtype={name!r}; use one of {', '.join(ROUTED_EXPERTS_DTYPES)}"
        ) from None


def no_router_marker(name: str) -> int:
    """The id a layer without a router holds: -1 (signed) or the dtype's maximum (unsigned)."""
    dt = wire_dtype(name)
    return -1 if dt.kind == "i" else int(np.iinfo(dt).max)


def max_num_experts(name: str) -> int:
    """The most experts whose ids (0 .. num_experts - 1) and the no-router marker ``name``
    holds: int32 2**31, int16 32768, uint16 65535, uint8 255."""
    dt = wire_dtype(name)
    top = int(np.iinfo(dt).max)
    return top + 1 if dt.kind == "i" else top


def _no_router_mask(rows: np.ndarray) -> np.ndarray:
    """Where ``rows`` (signed: -1; unsigned, e.g. a narrow host table: its maximum) mark a
    layer without a router."""
    if rows.dtype.kind == "u":
        return rows == np.iinfo(rows.dtype).max
    return rows < 0


def is_plain_cast(rows_dtype: np.dtype, name: str) -> bool:
    """Whether ``to_wire_dtype`` of rows in ``rows_dtype`` is just ``astype`` of the wire
    dtype ``name`` (signed -> signed: -1 stays -1), so that a copy the rows take anyway can
    cast them on the way."""
    return rows_dtype.kind == "i" and wire_dtype(name).kind == "i"


def to_wire_dtype(rows: np.ndarray, name: str) -> np.ndarray:
    """Rows of ids in any integer dtype -> the wire dtype ``name`` (the no-router marker
    translated). Done once, where rows leave the engine, before base64.

    Signed rows to the unsigned wire dtype of their width are a view, not a copy: -1 (no
    router) reads as the dtype's maximum, its marker, and every id is below it."""
    dt = wire_dtype(name)
    rows = np.asarray(rows)
    if rows.dtype == dt:
        return rows
    if (rows.dtype.kind == "i" and dt.kind == "u" and rows.dtype.itemsize == dt.itemsize
            and (dt.itemsize == 1 or sys.byteorder == "little")):  # the wire is little-endian
        return rows.view(dt)
    if rows.dtype.kind != dt.kind or rows.dtype.kind == "u":
        mask = _no_router_mask(rows)
        out = rows.astype(dt)
        if mask.any():
            out[mask] = no_router_marker(name)
        return out
    return rows.astype(dt)  # signed -> signed: -1 stays -1


def dtype_name(dt: np.dtype) -> str:
    """The wire name of a numpy integer dtype (``int32``, ``uint8``, ...)."""
    # The wire dtypes by a lookup: numpy builds a dtype's name in Python (~2 us), and every
    # routed-experts payload that goes into a response asks.
    name = _WIRE_NAMES.get(dt) if isinstance(dt, np.dtype) else None
    return name or np.dtype(dt).newbyteorder("=").name


def encode_routed_experts(rows: np.ndarray, dtype: str | None = None) -> str:
    """``[n, layers, k]`` ids -> base64 of their little-endian bytes in ``dtype`` (default:
    the rows' own dtype if it is a wire dtype, else int32)."""
    rows = np.asarray(rows)
    if dtype is None:
        dtype = dtype_name(rows.dtype)
        if dtype not in ROUTED_EXPERTS_DTYPES:
            dtype = DEFAULT_DTYPE
    data = np.ascontiguousarray(to_wire_dtype(rows, dtype), dtype=wire_dtype(dtype))
    # Straight from the array's buffer to a str: no bytes copy, no bytes -> str copy (3-4x
    # faster than b64encode(data.tobytes()).decode() for a 32k-token request).
    return pybase64.b64encode_as_string(data)


# Wire dtypes of the routing weights (``return_routed_expert_weights``), little-endian.
ROUTED_EXPERT_WEIGHTS_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
}
DEFAULT_WEIGHTS_DTYPE = "float32"
_WIRE_NAMES: dict[np.dtype, str] = {
    dt: name for names in (ROUTED_EXPERTS_DTYPES, ROUTED_EXPERT_WEIGHTS_DTYPES)
    for name, dt in names.items()}


def encode_routed_expert_weights(weights: np.ndarray, dtype: str = DEFAULT_WEIGHTS_DTYPE) -> str:
    """``[n, layers, k]`` routing weights -> base64 of their little-endian ``dtype`` bytes."""
    data = np.ascontiguousarray(weights, dtype=ROUTED_EXPERT_WEIGHTS_DTYPES[dtype])
    return pybase64.b64encode_as_string(data)


def _payload(data: Any, key: str) -> tuple[Any, Any]:
    """(meta_info, its ``key`` entry) of a response in any accepted form; Nones when absent."""
    meta = _meta_info(data)
    return meta, (None if meta is None else _get(meta, key))


def extract_routed_expert_weights_from_meta_info(data: Any) -> np.ndarray | None:
    """A response's routing weights (``meta_info["routed_expert_weights"]``), as
    ``extract_routed_experts_from_meta_info`` does for the ids: the same inputs, an array of
    ``routed_expert_weights_dtype`` shaped ``routed_expert_weights_shape``; None when absent."""
    return _extract_weights(data, "")


def _extract_weights(data: Any, prefix: str) -> np.ndarray | None:
    meta, encoded = _payload(data, f"{prefix}routed_expert_weights")
    if encoded is None:
        return None
    dt = ROUTED_EXPERT_WEIGHTS_DTYPES[
        _get(meta, f"{prefix}routed_expert_weights_dtype") or DEFAULT_WEIGHTS_DTYPE]
    return _shaped(_decode(encoded, dt), _get(meta, f"{prefix}routed_expert_weights_shape"))


def _decode(payload: str | bytes | bytearray | memoryview | np.ndarray,
            dt: np.dtype) -> np.ndarray:
    """A payload in any of its forms -> its values as a native-endian array of ``dt``:
    base64 (JSON, the default), raw little-endian bytes (a MessagePack body) or a numpy array
    (``Engine.generate(routed_experts_format="numpy")``). Raw bytes and arrays are not copied
    on a little-endian host: the array is a read-only view of the response's buffer."""
    if isinstance(payload, np.ndarray):
        return payload.astype(dt.newbyteorder("="), copy=False)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=dt).astype(dt.newbyteorder("="), copy=False)
    if not isinstance(payload, str):
        raise ValueError(f"a routed-experts payload is base64 text, bytes or a numpy array, "
                         f"not {type(payload).__name__}")
    raw = pybase64.b64decode(payload.encode("ascii"), validate=True)
    return np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="))


def _shaped(flat: np.ndarray, shape: Any) -> np.ndarray:
    return flat if shape is None else flat.reshape(tuple(shape))


def encoded_num_bytes(encoded: str) -> int:
    """The number of bytes a base64 string decodes to, without decoding it."""
    pad = len(encoded) - len(encoded.rstrip("="))
    return len(encoded) // 4 * 3 - pad


def decode_routed_experts(encoded: str | bytes | np.ndarray,
                          dtype: str = DEFAULT_DTYPE) -> np.ndarray:
    """base64 (or raw bytes, or an array) -> the flat ids, as a native-endian array of
    ``dtype``."""
    return _decode(encoded, wire_dtype(dtype)).reshape(-1)


def _get(obj: Any, name: str) -> Any:
    """``obj[name]`` of a mapping, or the attribute of an object (pydantic models of the
    ``openai`` client keep the fields they do not know, such as ``meta_info``, as attributes)."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None)  # pydantic v2 extras, if not attributes
        if isinstance(extra, Mapping):
            value = extra.get(name)
    return value


def _meta_info(data: Any) -> Any:
    """The ``meta_info`` of a response (dict or ``openai`` object), a choice or a chunk; a
    ``meta_info`` itself is returned as it is."""
    choices = _get(data, "choices")
    if choices is not None and not isinstance(data, str):
        choices = list(choices)
        if len(choices) != 1:
            raise ValueError(
                f"the response has {len(choices)} choices; pass one of them "
                "(e.g. response.choices[i]) to get its routed experts"
            )
        data = choices[0]
    meta = _get(data, "meta_info")
    return data if meta is None else meta


def extract_routed_experts_from_meta_info(data: Any) -> np.ndarray | None:
    """A response's routed experts (None when it carries none).

    ``data`` may be a response dict of the Engine or ``/generate`` (``{"meta_info": ...}``),
    its ``meta_info`` dict, an OpenAI response, choice or stream chunk (a dict or the
    ``openai`` client's object; a response with several choices needs one choice).

    The array has the ``routed_experts_dtype`` of the ``meta_info`` (int32 when absent) and
    its ``routed_experts_shape`` ``[rows, num_hidden_layers, num_experts_per_tok]``; without
    a shape it is flat (reshape with ``.reshape(-1, num_hidden_layers, num_experts_per_tok)``,
    which also works on the shaped array).
    """
    return _extract_ids(data, "")


def extract_prompt_routed_experts_from_meta_info(data: Any) -> np.ndarray | None:
    """The prompt's rows of a ``routed_experts_split`` response (``prompt_routed_experts``,
    in the first choice of each prompt), as ``extract_routed_experts_from_meta_info`` does
    for the rest; None when absent."""
    return _extract_ids(data, "prompt_")


def extract_prompt_routed_expert_weights_from_meta_info(data: Any) -> np.ndarray | None:
    """The prompt's routing weights of a ``routed_experts_split`` response; None when absent."""
    return _extract_weights(data, "prompt_")


def _extract_ids(data: Any, prefix: str) -> np.ndarray | None:
    meta, encoded = _payload(data, f"{prefix}routed_experts")
    if encoded is None:
        return None
    flat = _decode(encoded, wire_dtype(_get(meta, f"{prefix}routed_experts_dtype")
                                       or DEFAULT_DTYPE))
    return _shaped(flat, _get(meta, f"{prefix}routed_experts_shape"))
