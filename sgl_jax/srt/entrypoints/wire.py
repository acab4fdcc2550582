"""The body formats of the generation routes: JSON (the default) and MessagePack on request.

A client that sends ``Accept: application/msgpack`` gets its response as one MessagePack map
(the same keys as the JSON body) whose routed-experts and routing-weights arrays are raw
little-endian bytes (MessagePack ``bin``) with their dtype and shape beside them, as in JSON:
no base64, no string building. A stream is one MessagePack value per chunk, back to back
(``msgpack.Unpacker`` reads them as they come); it ends when the body ends, without the
``[DONE]`` event of the JSON stream. Errors before the first byte stay JSON, with their status.

The arrays reach the HTTP layer as numpy arrays (the request's ``routed_experts_format`` is
``numpy``) and are not packed at all: the packer writes the small rest of the body around a
placeholder per array, and the body goes out as that rest with each array's own buffer spliced
in (``Spliced``), in slices of at most ``SLICE_BYTES``. A large Python ``bytes`` costs a page
fault per 4 KiB when it is first written (a 48 MiB body: ~30 ms here, against ~5 ms to copy
into memory numpy already holds), so the arrays are never copied into one. Each slice goes to
the transport as the buffer it is (``http_connections._UnjoinedConnection``: h11 would join it
into a fresh ``bytes``); the transport copies only what the socket does not take at once, and
its flow control sends the next slice when the socket has taken the last.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import numpy as np
import orjson

JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
# What clients send for MessagePack besides the registered type (RFC 6838 lists none older).
_MSGPACK_ALIASES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack",
                              "application/vnd.msgpack"})
_JSON_RANGES = frozenset({JSON_MEDIA_TYPE, "application/*", "*/*"})


# A body is sent in slices of at most this many bytes (see the module's docstring).
SLICE_BYTES = 1 << 20
Buffer = bytes | memoryview


class Spliced(NamedTuple):
    """A MessagePack body as parts: the packed rest and the arrays' raw buffers, in order."""

    parts: list[Buffer]

    @property
    def nbytes(self) -> int:
        return sum(len(part) for part in self.parts)

    def slices(self, size: int = SLICE_BYTES) -> Iterator[Buffer]:
        for part in self.parts:
            if len(part) <= size:
                if part:
                    yield part
                continue
            view = memoryview(part)
            for begin in range(0, len(view), size):
                yield view[begin:begin + size]


# What a plan hands the HTTP layer: a JSON body, or a spliced MessagePack one.
Payload = bytes | Spliced


def payload_slices(payload: Payload) -> Iterator[Buffer]:
    if isinstance(payload, Spliced):
        yield from payload.slices()
    else:
        yield payload


@dataclass(frozen=True)
class Wire:
    """How one response is written: its media types, how a value becomes bytes and how a
    stream frames those bytes."""

    media_type: str
    stream_media_type: str
    dumps: Callable[[Any], Payload]
    frame: Callable[[Payload], Payload]  # a stream's chunk
    end: bytes | None  # what a stream sends last, if anything
    routed_experts_format: str  # how the tokenizer manager hands the arrays over


def _sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


# An array's placeholder in the packed rest: this process's random mark and the array's index,
# packed as a bin8 (0xc4, length). A placeholder is found by its packed bytes, and only in
# the small rest (text and ids are packed as str / int: a bin of exactly these random bytes
# comes from here alone).
_MARK = os.urandom(16)
_INDEX_BYTES = 4
_PLACEHOLDER_HEAD = bytes([0xC4, len(_MARK) + _INDEX_BYTES]) + _MARK
_MAX_BIN = (1 << 32) - 1


def msgpack_dumps(obj: Any) -> Spliced:
    """``obj`` as MessagePack, its numpy arrays as ``bin`` values of their raw bytes (in the
    arrays' own byte order: the routed-experts payloads are little-endian), numpy scalars as
    numbers; the arrays' buffers are spliced in, not copied."""
    arrays: list[np.ndarray] = []

    def packable(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            arrays.append(np.ascontiguousarray(value))
            if arrays[-1].nbytes > _MAX_BIN:
                raise ValueError(f"an array of {arrays[-1].nbytes} bytes exceeds MessagePack's "
                                 f"bin limit of {_MAX_BIN} bytes")
            return _MARK + (len(arrays) - 1).to_bytes(_INDEX_BYTES, "little")
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"cannot write a {type(value).__name__} as MessagePack")

    rest = msgpack.packb(obj, default=packable, use_bin_type=True)
    if not arrays:
        return Spliced([rest])
    view, parts, pos = memoryview(rest), [], 0
    for i, array in enumerate(arrays):
        placeholder = _PLACEHOLDER_HEAD + i.to_bytes(_INDEX_BYTES, "little")
        at = rest.index(placeholder, pos)
        parts += [view[pos:at], _bin_header(array.nbytes), _raw(array)]
        pos = at + len(placeholder)
    parts.append(view[pos:])
    return Spliced(parts)


def _raw(array: np.ndarray) -> Buffer:
    """A C-contiguous array's bytes, as a flat view (an empty array: no bytes)."""
    return memoryview(array.reshape(-1)).cast("B") if array.size else b""


def _bin_header(n: int) -> bytes:
    """The head of a MessagePack bin of ``n`` bytes (bin8 / bin16 / bin32, big-endian size)."""
    if n < 1 << 8:
        return bytes([0xC4, n])
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")



JSON_WIRE = Wire(JSON_MEDIA_TYPE, "text/event-stream", orjson.dumps, _sse_event,
                 _sse_event(b"[DONE]"), "base64")
MSGPACK_WIRE = Wire(MSGPACK_MEDIA_TYPE, MSGPACK_MEDIA_TYPE, msgpack_dumps,
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
