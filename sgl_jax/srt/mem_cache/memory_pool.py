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
    """Hands out KV slots in pages of ``page_size`` (P) tokens.

    Slot ``s`` is offset ``s % P`` of page ``s // P``. Pages ``1 .. size // P`` are usable;
    page 0 (slots ``0 .. P-1``) is reserved for padding (``PADDING_SLOT``). All counts are in
    tokens (``available_size()`` is free pages x P), so with ``P == 1`` a page is a slot and
    this is the plain free list of slots ``1 .. size`` it always was.

    The invariant the device page table relies on: a request's positions ``[i*P, (i+1)*P)``
    live in one page at offsets ``0 .. P-1`` in order (``req_to_token[idx, pos] ==
    page_i * P + pos % P``). ``alloc_extend`` / ``alloc_decode`` keep it: they first fill the
    rest of the request's last page, then take whole new pages. A page has one owner at a
    time (a request, or the radix tree, which holds whole pages only), so a partly filled
    last page is always its request's own and is never shared.

    Freeing (``free``): every page that one of the given slots belongs to goes back. Callers
    give a request's slots in position order, so the slots of one page are adjacent; what they
    free is whole pages plus at most one partial tail page per request (its positions
    ``[aligned_len, kv_len)``), and every page exactly once. Freeing a free page raises.

    Data-parallel attention gives each rank an allocator of its own over a contiguous range
    of the device's pages (``first_page``: the rank's reserved padding page, then its usable
    pages ``first_page + 1 .. first_page + size // P``), so a rank's requests only ever hold
    pages of the rank's shard of the KV cache.
    """

    def __init__(self, size: int, page_size: int = 1, first_page: int = 0) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} must be a power of two >= 1")
        if size < 0 or size % page_size:
            raise ValueError(f"size={size} must be a multiple of page_size={page_size}")
        if first_page < 0:
            raise ValueError(f"first_page={first_page} must be >= 0")
        self.page_size = page_size
        self.first_page = first_page  # the padding page; usable pages follow it
        self.size = size  # usable tokens
        self.num_pages = size // page_size  # usable pages, 1 .. num_pages
        self._offsets = np.arange(page_size, dtype=np.int32)
        self.clear()

    @property
    def padding_slot(self) -> int:
        """The slot padded tokens of this allocator's rank write (never handed out)."""
        return self.first_page * self.page_size

    @property
    def num_slots(self) -> int:
        """Rows of the flat KV (the usable pages plus the padding page), in tokens."""
        return (self.num_pages + 1) * self.page_size

    def available_size(self) -> int:
        """Free tokens: free pages x page_size."""
        return self._num_free * self.page_size

    def free_pages(self) -> np.ndarray:
        """The free page ids (a copy; for checks and tests)."""
        return self._free[: self._num_free].copy()

    def tokens_needed(self, kv_len: int, n: int) -> int:
        """``available_size()`` that extending a request of ``kv_len`` positions by ``n``
        takes: its new pages x page_size (the rest of its last page is its own already)."""
        p = self.page_size
        if p == 1:
            return n
        return (-(-(kv_len + n) // p) + (kv_len // -p)) * p

    # -- allocation -----------------------------------------------------------------------------
    def _take(self, k: int) -> np.ndarray | None:
        if k > self._num_free:
            return None
        start = self._num_free - k
        pages = self._free[start : self._num_free].copy()
        self._num_free = start
        self._is_free[pages - self.first_page] = False
        return pages

    def alloc(self, n: int) -> np.ndarray | None:
        """Slots of positions ``0 .. n-1`` of a new request (``ceil(n / P)`` fresh pages)."""
        if self.page_size == 1:
            return self._take(n)
        return self.alloc_extend(n, 0)

    def alloc_extend(self, n: int, kv_len: int = 0, last_slot: int = -1) -> np.ndarray | None:
        """Slots of positions ``kv_len .. kv_len+n-1`` of a request that holds ``kv_len``.

        ``last_slot`` is the slot of position ``kv_len - 1`` (needed when ``kv_len % P``):
        the rest of its page comes first, then whole new pages. None (and nothing taken) when
        there are not enough free pages.
        """
        p = self.page_size
        if p == 1:
            return self._take(n)
        fill = min(-kv_len % p, n)  # free offsets left in the request's last page
        if fill and last_slot % p != (kv_len - 1) % p:
            raise ValueError(f"slot {last_slot} cannot hold position {kv_len - 1} (page {p})")
        pages = self._take(-(-(n - fill) // p))
        if pages is None:
            return None
        out = np.empty(n, dtype=np.int32)
        out[:fill] = np.arange(last_slot + 1, last_slot + 1 + fill, dtype=np.int32)
        out[fill:] = (pages[:, None] * p + self._offsets).reshape(-1)[: n - fill]
        return out

    def alloc_decode(self, kv_lens: np.ndarray, last_slots: np.ndarray | None) -> np.ndarray | None:
        """One slot for each of many requests: slot of position ``kv_lens[i]`` of request i.

        ``last_slots[i]`` is the slot of position ``kv_lens[i] - 1`` (unused, and may be None,
        with ``P == 1``). A request whose last page is full gets a new page. O(batch) numpy;
        None (and nothing taken) when there are not enough free pages.
        """
        p = self.page_size
        if p == 1:
            return self._take(len(kv_lens))
        kv_lens = np.asarray(kv_lens)
        new = kv_lens % p == 0
        pages = self._take(int(np.count_nonzero(new)))
        if pages is None:
            return None
        out = np.asarray(last_slots, dtype=np.int32) + 1
        out[new] = pages * p
        return out

    def decode_tokens_needed(self, kv_lens: np.ndarray) -> int:
        """``available_size()`` that ``alloc_decode(kv_lens, ...)`` takes."""
        if self.page_size == 1:
            return len(kv_lens)
        return int(np.count_nonzero(np.asarray(kv_lens) % self.page_size == 0)) * self.page_size

    # -- release ----------------------------------------------------------------------------------
    def free(self, slots: np.ndarray) -> None:
        """Gives back every page that one of ``slots`` belongs to (see the class docstring)."""
        if len(slots) == 0:
            return
        slots = np.asarray(slots)
        if self.page_size == 1:
            pages = slots
        else:
            pages = slots // self.page_size
            if len(pages) > 1:  # a page's slots are adjacent: keep each run's first
                pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        k = len(pages)
        if self._num_free + k > self.num_pages:
            raise RuntimeError("more KV pages freed than were allocated")
        local = pages - self.first_page
        if local.min() < 0 or local.max() > self.num_pages:
            raise RuntimeError(f"KV pages outside this allocator's range were freed: {pages}")
        if self._is_free[local].any():
            raise RuntimeError("a KV page was freed twice, or was never handed out")
        self._is_free[local] = True
        self._free[self._num_free : self._num_free + k] = pages
        self._num_free += k

    def clear(self) -> None:
        self._free = np.arange(  # a stack: top at the end
            self.first_page + 1, self.first_page + self.num_pages + 1, dtype=np.int32)
        self._num_free = self.num_pages
        # The padding page counts as free, so that freeing it raises; it is never handed out.
        # Indexed by page - first_page.
        self._is_free = np.ones(self.num_pages + 1, dtype=bool)
