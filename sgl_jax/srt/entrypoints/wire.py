"""The body formats of the generation routes: JSON (the default) and MessagePack on request.

A client that sends ``Accept: application/msgpack`` gets its response as one MessagePack map
(the same keys as the JSON body) whose routed-experts and routing-weights arrays are raw
little-endian bytes (MessagePack ``bin``) with their dtype and shape beside them, as in JSON:
no base64, no string building. A stream is one MessagePack value per chunk, back to back
(``msgpack.Unpacker`` reads them as they come); it ends when the body ends, without the
``[DONE]`` event of the JSON stream. Errors before the first byte stay JSON, with their status.

The arrays reach the HTTP layer as numpy arrays (the request's ``routed_experts_format`` is
``numpy``) and are copied once, into the body, by the packer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import orjson

JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
# What clients send for MessagePack besides the registered type (RFC 6838 lists none older).
_MSGPACK_ALIASES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack",
                              "application/vnd.msgpack"})
_JSON_RANGES = frozenset({JSON_MEDIA_TYPE, "application/*", "*/*"})


@dataclass(frozen=True)
class Wire:
    """How one response is written: its media types, how a value becomes bytes and how a
    stream frames those bytes."""

    name: str
    media_type: str
    stream_media_type: str
    dumps: Callable[[Any], bytes]
    frame: Callable[[bytes], bytes]
    end: bytes | None  # what a stream sends last, if anything
    routed_experts_format: str  # how the tokenizer manager hands the arrays over


def _sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def _packable(obj: Any) -> Any:
    """numpy values for the packer: arrays as their raw bytes (a view: the packer copies them
    once into the body), scalars as Python numbers."""
    if isinstance(obj, np.ndarray):
        return memoryview(np.ascontiguousarray(obj)).cast("B")
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot write a {type(obj).__name__} as MessagePack")


def msgpack_dumps(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_packable, use_bin_type=True)


JSON_WIRE = Wire("json", JSON_MEDIA_TYPE, "text/event-stream", orjson.dumps, _sse_event,
                 _sse_event(b"[DONE]"), "base64")
MSGPACK_WIRE = Wire("msgpack", MSGPACK_MEDIA_TYPE, MSGPACK_MEDIA_TYPE, msgpack_dumps,
                    lambda data: data, None, "numpy")


def negotiate(accept: str | None) -> Wire:
    """The wire an ``Accept`` header asks for: MessagePack when it names it with a quality
    above zero and at least that of JSON; JSON otherwise (and without the header)."""
    if not accept:
        return JSON_WIRE
    msgpack_q = json_q = 0.0
    for media_range in accept.split(","):
        media_type, *params = (part.strip() for part in media_range.split(";"))
        q = _quality(params)
        media_type = media_type.lower()
        if media_type in _MSGPACK_ALIASES:
            msgpack_q = max(msgpack_q, q)
        elif media_type in _JSON_RANGES:
            json_q = max(json_q, q)
    return MSGPACK_WIRE if msgpack_q > 0 and msgpack_q >= json_q else JSON_WIRE


def _quality(params: list[str]) -> float:
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return min(max(float(value), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 1.0
