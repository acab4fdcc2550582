"""Host-side bookkeeping pools: request slots and KV token slots.

Pools only hand out and take back indices; the request object owns what it holds.
"""

from __future__ import annotations

import numpy as np

PADDING_SLOT = 0  # KV slot written by padded tokens; never handed out, never read back.


class ReqToTokenPool:
    """``req_to_token[req_pool_idx, pos]`` is the KV slot of position ``pos`` of a request."""

    def __init__(self, size: int, max_context_len: int) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        # Leading positions of each slot's row whose pages the device page table already
        # holds (ModelRunner.req_to_page); a new occupant starts with none.
        self.device_len = np.zeros(size, dtype=np.int64)
        self._free: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        idx = self._free.pop()
        self.device_len[idx] = 0
        return idx

    def free(self, req_pool_idx: int) -> None:
        if req_pool_idx in self._free:
            raise RuntimeError(f"request slot {req_pool_idx} freed twice")
        self._free.append(req_pool_idx)

    def write(self, req_pool_idx: int, start: int, slots: np.ndarray) -> None:
        self.req_to_token[req_pool_idx, start : start + len(slots)] = slots

    def clear(self) -> None:
        self._free = list(range(self.size))


class TokenToKVPoolAllocator:
    """Free list of KV token slots ``1 .. size``; slot 0 is reserved for padding."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size != 1:
            raise NotImplementedError("paged allocation is being added")
        self.page_size = page_size
        self.size = size
        self._free = np.arange(1, size + 1, dtype=np.int32)
        self._num_free = size

    @property
    def num_slots(self) -> int:
        """Rows of each KV array (the usable slots plus the padding slot)."""
        return self.size + 1

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].copy()
        self._num_free = start
        return out

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        if self._num_free + n > self.size:
            raise RuntimeError("more KV slots freed than were allocated")
        self._free[self._num_free : self._num_free + n] = slots
        self._num_free += n

    def clear(self) -> None:
        self._free = np.arange(1, self.size + 1, dtype=np.int32)
        self._num_free = self.size
