"""Messages between processes: a pickled io_struct dataclass, its large arrays out of band.

``send_obj`` pickles with protocol 5 and hands every contiguous numpy array (routed-experts
rows) to ZMQ as its own frame of raw bytes, without a copy into the pickle; ``recv_obj``
rebuilds the object with arrays that are read-only views of the received frames. So rows are
never serialized into a pickle stream, never base64-encoded between processes, and never copied
by the transport beyond what ZMQ itself does.

Both ends of a socket must use these two functions (they replace ``send_pyobj`` /
``recv_pyobj`` on the scheduler -> detokenizer -> tokenizer manager sockets).

The side channel (M21: the finish path without a detour). A large array (a finishing request's
routed-experts rows) need not pass through the detokenizer, which never reads it: the scheduler
puts it in a ``SideSender`` (``put`` returns a ``SideArray``, a reference that stands in for the
array in the message) and ``flush``es it, straight to the tokenizer manager's ``SideReceiver``,
before the message that refers to it. The message pickles the reference (a few bytes); the
detokenizer unpickles it as a reference and passes it on unchanged; the tokenizer manager, whose
``recv_obj(..., side=receiver)`` resolves references, gets the array as a read-only view of the
side frame. So the rows cross one socket instead of two. Side data is sent before the message
that refers to it, so a receiver waits for it only while it is in flight; data of several
senders (schedulers) is kept by key until its message comes.

With a shared-memory arena (``shm_arena.py``, the default on Linux), a
large array does not cross a socket at all: ``put`` copies it into the arena and the reference
(an ``ArenaRef``) names its range; the socket carries only arrays the arena has no room for.
"""

from __future__ import annotations

import pickle
import secrets
import threading
import time
from typing import Any

import numpy as np
import zmq

from sgl_jax.srt.managers.shm_arena import (
    ArenaReader,
    ArenaRef,
    ArenaWriter,
    resolving_in_this_thread,
)


def send_obj(socket: zmq.Socket, obj: Any, flags: int = 0) -> None:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        socket.send(head, flags)
        return
    # Zero-copy: ZMQ keeps the buffers alive until sent (pyzmq still copies small frames).
    socket.send_multipart([head, *(b.raw() for b in buffers)], flags, copy=False)


def recv_obj(socket: zmq.Socket, flags: int = 0, side: SideReceiver | None = None) -> Any:
    """The next object; with ``side``, its ``SideArray`` references become their arrays (taken
    from ``side``), else they stay references."""
    frames = socket.recv_multipart(flags, copy=False)
    _resolving.side = side
    resolving_in_this_thread(None if side is None else side.arena)
    try:
        return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])
    finally:
        _resolving.side = None
        resolving_in_this_thread(None)


# -- the side channel ---------------------------------------------------------------------------

# Arrays smaller than this stay in the message: below it a second socket costs more than the
# detokenizer's hop (~0.3 ms per MiB per hop here).
SIDE_MIN_BYTES = 1 << 20
# How long a receiver waits for side data already sent before its message (a sender that died
# mid-send): then the message fails instead of hanging the receiver.
SIDE_WAIT_S = 60.0


def side_address(address: str) -> str:
    """The side channel's endpoint beside a receiver's ``address`` (its ``ipc://`` path + _side)."""
    return address + "_side"


class SideArray:
    """A reference to side array ``index`` of side message ``key``, in place of the array in a
    message. Pickles as the reference; unpickles as the array where the receiving thread
    resolves references (``recv_obj(..., side=...)``), else as the reference again (the
    detokenizer, which passes it on)."""

    __slots__ = ("key", "index", "dtype", "shape", "array")

    def __init__(self, key: bytes, index: int, dtype: str, shape: tuple[int, ...],
                 array: np.ndarray | None = None) -> None:
        self.key, self.index, self.dtype, self.shape = key, index, dtype, shape
        self.array = array  # the sender's, until sent; never pickled

    def __reduce__(self) -> tuple:
        return _side_array, (self.key, self.index, self.dtype, self.shape)

    def __repr__(self) -> str:
        return f"SideArray({self.key.hex()}[{self.index}], {self.dtype}, {self.shape})"


_resolving = threading.local()  # .side: the SideReceiver of the recv_obj running in this thread


def _side_array(key: bytes, index: int, dtype: str, shape: tuple[int, ...]) -> Any:
    side: SideReceiver | None = getattr(_resolving, "side", None)
    if side is None:
        return SideArray(key, index, dtype, shape)
    array = np.frombuffer(side.take(key, index), np.dtype(dtype)).reshape(shape)
    array.flags.writeable = False  # the receiver's view of what was sent
    return array


class SideSender:
    """The sending end: ``put`` large arrays while building a message, ``flush`` before sending
    it. Owns its PUSH socket (connected to the receiver's ``side_address``)."""

    def __init__(self, ctx: zmq.Context, address: str, min_bytes: int | None = None,
                 arena: ArenaWriter | None = None) -> None:
        # Smaller arrays stay in the message (default: SIDE_MIN_BYTES).
        self.min_bytes = SIDE_MIN_BYTES if min_bytes is None else min_bytes
        self.arena = arena  # tried first; the socket takes what it has no room for
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.connect(side_address(address))
        # Unique per sender (several schedulers, maybe threads of one process, share a receiver).
        self._prefix = secrets.token_bytes(8)
        self._count = 0
        self._pending: list[SideArray] = []
        self._key = self._next_key()

    def _next_key(self) -> bytes:
        self._count += 1
        return self._prefix + self._count.to_bytes(8, "little")

    def put(self, array: np.ndarray,
            dtype: np.dtype | None = None) -> np.ndarray | SideArray | ArenaRef:
        """``array`` (cast to ``dtype`` if given, as ``astype`` casts) itself if it is small
        (or not contiguous), else its reference: a range of the arena it was copied into
        (cast on the way: one pass), or one to be sent by the next ``flush``."""
        dtype = array.dtype if dtype is None else np.dtype(dtype)
        if array.size * dtype.itemsize < self.min_bytes or not array.flags.c_contiguous:
            return array.astype(dtype, copy=False)
        if self.arena is not None and (in_arena := self.arena.put(array, dtype)) is not None:
            return in_arena
        array = array.astype(dtype, copy=False)
        ref = SideArray(self._key, len(self._pending), array.dtype.str, array.shape, array)
        self._pending.append(ref)
        return ref

    def flush(self) -> None:
        """Sends the arrays ``put`` since the last flush (as one message, zero-copy)."""
        if not self._pending:
            return
        frames = [self._key, *(ref.array for ref in self._pending)]
        self.socket.send_multipart(frames, copy=False)
        for ref in self._pending:
            ref.array = None
        self._pending = []
        self._key = self._next_key()

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.arena is not None:
            self.arena.close()


class SideReceiver:
    """The receiving end, bound at ``side_address(address)``: side data by key until the
    message that refers to it resolves it (``recv_obj(socket, side=receiver)``). Used by one
    thread (the receiver of ``address``)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(side_address(address))
        self._stash: dict[bytes, list[Any]] = {}
        self._left: dict[bytes, int] = {}  # arrays of a key not yet taken
        self.arena = ArenaReader()  # maps the senders' arenas as their references come

    def take(self, key: bytes, index: int) -> Any:
        """Array ``index`` of side message ``key`` (a read-only buffer), waiting for it if it
        is still in flight."""
        deadline = time.monotonic() + SIDE_WAIT_S
        while key not in self._stash:
            if not self.socket.poll(timeout=100):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"side data {key.hex()} did not arrive")
                continue
            frames = self.socket.recv_multipart(copy=False)
            got = bytes(frames[0].buffer)
            self._stash[got] = [f.buffer for f in frames[1:]]
            self._left[got] = len(frames) - 1
        buffer = self._stash[key][index]
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._stash[key], self._left[key]
        return buffer

    def pending(self) -> int:
        """Side messages received and not yet fully taken."""
        return len(self._stash)

    def close(self) -> None:
        self.socket.close(linger=0)
