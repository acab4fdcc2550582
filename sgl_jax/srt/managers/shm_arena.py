"""Large arrays from the scheduler to the tokenizer manager through shared memory.

The side channel (``transport.py``) sends a finishing request's routed-experts rows straight to
the tokenizer manager; over a socket that costs a kernel copy each way and, on the receiving
side, a fresh buffer whose pages fault in as they are written: ~35 ms for 48 MiB here (a
32k-token request of a 48-layer, top-8 model in int32). An arena avoids both: the scheduler
copies the rows into shared memory mapped by both processes (pages that stay mapped, so after
the first use nothing faults) and sends a reference of a few bytes; the tokenizer manager reads
the rows in place.

The memory is an anonymous ``memfd`` of the scheduler's: it has no name in any file system, so
nothing is left behind whatever way the processes end, and its pages are taken as they are
first written (up to the arena's size), not up front. The tokenizer manager maps it through
``/proc/<scheduler pid>/fd/<fd>`` (same user; checked to be the memfd the reference names).

Ownership of a range, without locks. The header holds one state byte per slot:

- the writer (scheduler) takes a free slot and a free range, writes the array, sets the state
  to ``BUSY`` and only then sends the reference (so the data is there before the reference can
  be read);
- the reader (tokenizer manager) hands out read-only numpy views whose base is a *lease*; when
  the last view of a lease is gone, the lease sets the state back to ``FREE``;
- the writer reclaims slots it sees ``FREE`` before it allocates again.

Each transition has one writer (FREE -> BUSY the scheduler, BUSY -> FREE the manager), so single
byte stores suffice. A reference that never reaches the reader (it cannot be lost on the way:
the detokenizer forwards every message) or a view a caller keeps forever pins only its own
range; when no range fits, ``put`` returns None and the array takes the socket instead. Nothing
ever waits for the arena.

In-process callers (``Engine.generate(..., routed_experts_format="numpy")``) get copies, not
views (``TokenizerManager``): an RL loop keeps its rollouts' arrays for a training step, and
they must not pin the arena meanwhile. The HTTP route borrows the views until the body is sent.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import sys
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

MAX_SLOTS = 4096  # ranges in use at once; beyond it, arrays take the socket
_DATA_START = 1 << 16  # the state bytes, then the data (page aligned)
_ALIGN = 64
FREE, BUSY = 0, 1
_NAME = re.compile(r"sgl_jax_arena_[0-9a-f]{32}")  # the memfd's name, in its /proc link


class ArenaRef:
    """A reference to ``shape``/``dtype`` bytes at ``offset`` of arena ``name`` (slot
    ``slot``; the memfd ``fd`` of process ``pid``), in place of the array in a message.
    Unpickles as the array in a thread that resolves references (``resolving_in_this_thread``,
    which ``transport.recv_obj(..., side=...)`` sets), else as itself."""

    __slots__ = ("name", "pid", "fd", "slot", "offset", "dtype", "shape")

    def __init__(self, name: str, pid: int, fd: int, slot: int, offset: int, dtype: str,
                 shape: tuple[int, ...]) -> None:
        self.name, self.pid, self.fd = name, pid, fd
        self.slot, self.offset, self.dtype, self.shape = slot, offset, dtype, tuple(shape)

    def __reduce__(self) -> tuple:
        return _arena_array, (self.name, self.pid, self.fd, self.slot, self.offset,
                              self.dtype, self.shape)

    def __repr__(self) -> str:
        return f"ArenaRef({self.name}[{self.slot}]@{self.offset}, {self.dtype}, {self.shape})"


# .reader: the ArenaReader that turns references unpickled in this thread into views (the
# transport's receiving end sets it around each message; this module never imports it).
_resolving = threading.local()


def resolving_in_this_thread(reader: ArenaReader | None) -> None:
    """From now on, ``ArenaRef``s unpickled in this thread become views of ``reader``'s
    arenas (None: they stay references, as in the detokenizer, which passes them on)."""
    _resolving.reader = reader


def _arena_array(*ref: Any) -> Any:  # ArenaRef's fields
    reader: ArenaReader | None = getattr(_resolving, "reader", None)
    return ArenaRef(*ref) if reader is None else reader.array(*ref)


class ArenaWriter:
    """The scheduler's end: ``put`` copies an array into a free range and returns its
    reference."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap) -> None:
        self.name, self.fd, self.pid, self.size = name, fd, os.getpid(), len(mm)
        self._data = np.frombuffer(mm, np.uint8)  # keeps the mapping alive
        self._states = self._data[:MAX_SLOTS]
        self._live: dict[int, tuple[int, int]] = {}  # slot -> (offset, nbytes)

    @classmethod
    def create(cls, megabytes: int) -> ArenaWriter | None:
        """An arena of ``megabytes`` MiB of data, or None (logged) where there can be none
        (``megabytes`` 0, or no memfd: not Linux)."""
        if megabytes <= 0:
            return None
        if not sys.platform.startswith("linux"):
            logger.info("routed-experts arena: needs Linux (memfd); large arrays take a socket")
            return None
        name = f"sgl_jax_arena_{secrets.token_hex(16)}"
        size = _DATA_START + (megabytes << 20)
        try:
            fd = os.memfd_create(name)  # close-on-exec
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except OSError as e:
            logger.warning("routed-experts arena: no shared memory (%s); large arrays take a "
                           "socket", e)
            return None
        logger.info("routed-experts arena: up to %d MiB of shared memory", megabytes)
        return cls(name, fd, mm)

    def put(self, array: np.ndarray, dtype: np.dtype | None = None) -> ArenaRef | None:
        """``array`` copied into the arena, or None when no slot or range is free. With
        ``dtype``, the copy is also the cast (``array.astype(dtype)``'s values): one pass over
        memory that stays mapped, where a cast first would write a fresh array."""
        dtype = array.dtype if dtype is None else np.dtype(dtype)
        nbytes = array.size * dtype.itemsize
        self._reclaim()
        slot = self._free_slot()
        offset = None if slot is None else self._first_fit(nbytes)
        if offset is None:
            return None
        dst = self._data[offset:offset + nbytes].view(dtype).reshape(array.shape)
        np.copyto(dst, array, casting="unsafe")  # astype's semantics
        self._live[slot] = (offset, nbytes)
        self._states[slot] = BUSY  # before the reference leaves: the reader frees it
        return ArenaRef(self.name, self.pid, self.fd, slot, offset, dtype.str, array.shape)

    def in_use(self) -> int:
        """Slots whose ranges the reader has not released yet."""
        self._reclaim()
        return len(self._live)

    def _reclaim(self) -> None:
        for slot in [s for s in self._live if self._states[s] == FREE]:
            del self._live[slot]

    def _free_slot(self) -> int | None:
        if len(self._live) >= MAX_SLOTS:
            return None
        # A slot not live is FREE (the reader only frees live ones); the lowest such.
        used = self._live.keys()
        return next(s for s in range(MAX_SLOTS) if s not in used)

    def _first_fit(self, nbytes: int) -> int | None:
        """The lowest aligned offset with ``nbytes`` free after it (live ranges are few)."""
        at = _DATA_START
        for offset, length in sorted(self._live.values()):
            if offset - at >= nbytes:
                return at
            at = max(at, -(-(offset + length) // _ALIGN) * _ALIGN)
        return at if self.size - at >= nbytes else None

    def close(self) -> None:
        """Closes the memfd (a reader that mapped it keeps its mapping, and so the memory)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Lease:
    """One range lent to the reader's views: the end of the ``.base`` chain of every numpy
    view of it, so the lease lives exactly as long as some view does. Gone, it frees the slot
    for the writer."""

    __slots__ = ("_arena", "_slot", "__array_interface__")

    def __init__(self, arena: _MappedArena, slot: int, offset: int, dtype: str,
                 shape: tuple[int, ...]) -> None:
        self._arena, self._slot = arena, slot
        self.__array_interface__ = {
            "version": 3, "shape": shape, "typestr": dtype,
            "data": (arena.address + offset, True),  # read-only
        }

    def __del__(self) -> None:
        self._arena.states[self._slot] = FREE


class _MappedArena:
    def __init__(self, mm: mmap.mmap) -> None:
        self.whole = np.frombuffer(mm, np.uint8)  # keeps the mapping (and its address) alive
        self.states = self.whole[:MAX_SLOTS]
        self.address = self.whole.ctypes.data
        self.size = len(mm)


class ArenaReader:
    """The tokenizer manager's end: maps each writer's arena once and turns references into
    read-only views that free their range when the last one is gone."""

    def __init__(self) -> None:
        self._arenas: dict[str, _MappedArena] = {}

    def array(self, name: str, pid: int, fd: int, slot: int, offset: int, dtype: str,
              shape: tuple[int, ...]) -> np.ndarray:
        arena = self._arenas.get(name) or self._map(name, pid, fd)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not (0 <= slot < MAX_SLOTS and _DATA_START <= offset and 0 <= nbytes
                and offset + nbytes <= arena.size):
            raise ValueError(f"arena reference out of range: slot {slot}, {nbytes} bytes at "
                             f"{offset} of {arena.size}")
        return np.asarray(_Lease(arena, slot, offset, dtype, tuple(shape)))

    def _map(self, name: str, pid: int, fd: int) -> _MappedArena:
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        opened = os.open(path, os.O_RDWR)
        try:
            # The descriptor must be the memfd the reference names (not whatever else that
            # process may have open under that number).
            link = os.readlink(f"/proc/self/fd/{opened}")
            if not (_NAME.fullmatch(name) and link.startswith(f"/memfd:{name}")):
                raise ValueError(f"{path} is {link!r}, not the arena {name!r}")
            mm = mmap.mmap(opened, os.fstat(opened).st_size)
        finally:
            os.close(opened)
        arena = self._arenas[name] = _MappedArena(mm)
        return arena


def is_borrowed(array: Any) -> bool:
    """Whether ``array`` is a view of an arena range (to be copied before it is kept)."""
    base = array
    while isinstance(base, np.ndarray):  # a view's base may be the array it was taken from
        base = base.base
    return isinstance(base, _Lease)
