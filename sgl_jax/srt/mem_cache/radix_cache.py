"""Radix (prefix) cache: token-id sequences -> the KV slots that hold their K/V.

A request whose prompt starts with a cached sequence reuses those slots and skips recomputing
them. Host-side bookkeeping only (numpy); the KV arrays themselves live on the device.

Ownership of KV slots (the rule that keeps the allocator leak-free):

- Every slot stored in the tree is owned by the tree, and held by exactly one node. The tree
  gives slots back to the allocator only in ``evict``.
- ``match_prefix`` lends the tree's slots to a request; the request locks the returned node
  (``inc_lock_ref``) for as long as it reads them, which also guarantees that
  ``insert`` later finds at least that prefix again.
- ``insert(token_ids, kv_slots)`` returns ``n``, the length of the prefix that was already in
  the tree before the call. The tree keeps its own slots for positions ``[0, n)`` and takes
  ownership of ``kv_slots[n:]``. The caller must free ``kv_slots[cached_len:n]`` where
  ``cached_len`` is the number of leading positions whose slots in ``kv_slots`` already *are*
  the tree's (the length returned by its ``match_prefix``, or of its previous ``insert`` if it
  re-matched since). Those are duplicates: another request cached the same tokens meanwhile.
  ``n >= cached_len`` holds as long as the request kept its lock. Freeing ``kv_slots[:n]``
  instead would free the tree's own slots and corrupt the cache.
- With ``disable=True`` the tree keeps nothing: ``insert`` returns 0 and takes no slots, so the
  caller owns, and must free, all of ``kv_slots``.

Pages (``page_size`` P > 1): the tree holds whole pages only, so that a page has one owner.
Every node's key is a multiple of P long and its value is whole pages (``value[i] ==
page * P + i % P``); ``match_prefix`` returns a multiple of P and splits only at page
boundaries; ``insert`` caches only the page-aligned part ``[0, aligned_len)``, ``aligned_len =
len // P * P``, so besides the duplicates ``kv_slots[cached_len:returned]`` the caller must also
free the unaligned tail ``kv_slots[aligned_len:]`` (one partial page, its own). ``evict``
frees whole pages, and all sizes stay in tokens (multiples of P).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from sgl_jax.srt.mem_cache.memory_pool import TokenToKVPoolAllocator

_EMPTY = np.zeros(0, dtype=np.int32)
_node_ids = itertools.count()


class TreeNode:
    """An edge of the radix tree: a run of tokens (``key``) and their KV slots (``value``).

    Invariants: ``len(key) == len(value)`` (> 0 except at the root, a multiple of the page
    size); the children of a node start with distinct first pages and are keyed by that page
    (``RadixCache.child_key``: the first token itself when P == 1, the first page's bytes when
    P > 1, so that children sharing a first token but differing within the first page
    coexist); ``lock_ref`` of a node is at least the ``lock_ref`` of any child (locks are taken
    on a node and all its ancestors).
    """

    __slots__ = ("id", "key", "value", "children", "parent", "lock_ref", "last_access_time")

    def __init__(
        self,
        key: np.ndarray = _EMPTY,
        value: np.ndarray = _EMPTY,
        parent: TreeNode | None = None,
        lock_ref: int = 0,
        last_access_time: int = 0,
    ) -> None:
        self.id = next(_node_ids)  # creation order; breaks ties between equal access times
        self.key = key
        self.value = value
        self.children: dict[int | bytes, TreeNode] = {}
        self.parent = parent
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixCache:
    def __init__(
        self, allocator: TokenToKVPoolAllocator, disable: bool = False,
        page_size: int | None = None,
    ) -> None:
        """``page_size`` defaults to the allocator's and must equal it."""
        if page_size is not None and page_size != allocator.page_size:
            raise ValueError(f"page_size={page_size} but the allocator's pages hold "
                             f"{allocator.page_size} tokens")
        self.allocator = allocator
        self.disable = disable
        self.page_size = allocator.page_size
        # A logical clock rather than wall time: strictly increasing, so LRU order is exact
        # and deterministic in tests.
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget the whole tree WITHOUT freeing its slots to the allocator.

        Meant for flushing the cache (``/flush_cache``) when no request is running: the caller
        then clears the allocator (``allocator.clear()``) and the request pool itself, so
        freeing slot by slot here would be wasted work. Calling ``reset`` while the allocator
        still counts the tree's slots as used leaks them; to give them back one by one instead,
        call ``evict(total_size())`` (which skips locked nodes).
        """
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted and holds no slots
        self._evictable_size = 0
        self._protected_size = 0

    # ---- lookup and insertion --------------------------------------------------------------

    def child_key(self, key: np.ndarray, pos: int = 0) -> int | bytes:
        """The children-dict key of a run of tokens starting at ``key[pos]``: its first page."""
        if self.page_size == 1:
            return int(key[pos])
        return key[pos : pos + self.page_size].tobytes()

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[np.ndarray, TreeNode]:
        """Longest cached prefix of ``token_ids`` in whole pages: (its KV slots, the deepest
        node matched); the length is a multiple of the page size.

        If the match ends inside a node the node is split (at a page boundary), so the returned
        node covers exactly the matched prefix and locking it protects exactly those slots. The
        slots are lent, not given: lock the node before relying on them.
        """
        if self.disable or len(token_ids) < self.page_size:
            return _EMPTY.copy(), self.root
        page = self.page_size
        key = np.asarray(token_ids, dtype=np.int32)
        if page > 1:
            key = key[: len(key) - len(key) % page]
        now = next(self._clock)
        node, pos, values = self.root, 0, []
        node.last_access_time = now
        while pos < len(key):
            # child_key, inlined: this loop is the hot path of admission
            child = node.children.get(
                int(key[pos]) if page == 1 else key[pos : pos + page].tobytes()
            )
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:])
            if page > 1:
                n -= n % page  # >= page: the child's first page matched as a whole
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + n
            # After a split, the page at key[pos] (if any) differs from the split-off tail's
            # first page: the next lookup misses and the loop ends.
        slots = np.concatenate(values) if values else _EMPTY.copy()
        return slots, node

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``token_ids`` (whole pages), read-only: no
        split, no access-time update, so looking without using changes no eviction order
        (the DP balancer asks every rank's tree where a new request's prefix is cached)."""
        if self.disable or len(token_ids) < self.page_size:
            return 0
        page = self.page_size
        key = np.asarray(token_ids, dtype=np.int32)
        if page > 1:
            key = key[: len(key) - len(key) % page]
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self.child_key(key, pos))
            if child is None:
                break
            n = _common_prefix_len(child.key, key[pos:])
            if page > 1:
                n -= n % page
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, token_ids: Sequence[int], kv_slots: np.ndarray) -> int:
        """Cache the page-aligned part of ``token_ids`` with their ``kv_slots``; return the
        prefix length already cached (a multiple of the page size).

        The tree takes ownership of ``kv_slots[returned:aligned_len]``; see the module docstring
        for which of the caller's slots it must free (``kv_slots[cached_len:returned]`` and,
        with pages, the unaligned tail ``kv_slots[aligned_len:]``).
        """
        if self.disable:
            return 0
        key = np.asarray(token_ids, dtype=np.int32)
        value = np.asarray(kv_slots, dtype=np.int32)
        if key.shape != value.shape or key.ndim != 1:
            raise ValueError(f"token_ids {key.shape} and kv_slots {value.shape} differ in shape")
        page = self.page_size
        if page > 1:
            aligned = len(key) - len(key) % page
            key, value = key[:aligned], value[:aligned]
        now = next(self._clock)
        node, pos = self.root, 0
        node.last_access_time = now
        while pos < len(key):
            child = node.children.get(
                int(key[pos]) if page == 1 else key[pos : pos + page].tobytes()
            )
            if child is None:
                # Copy so the caller reusing its buffer cannot change what the tree holds.
                leaf = TreeNode(key[pos:].copy(), value[pos:].copy(), node, 0, now)
                node.children[self.child_key(leaf.key)] = leaf
                self._evictable_size += len(leaf.key)
                break
            n = _common_prefix_len(child.key, key[pos:])
            if page > 1:
                n -= n % page
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            node, pos = child, pos + n
        return pos

    def offer_duplicates(
        self, token_ids: Sequence[int], kv_slots: np.ndarray, start: int,
        prefer: Callable[[np.ndarray, np.ndarray], bool],
    ) -> np.ndarray:
        """Offers the tree ``kv_slots[start:]``, a caller's own copies of positions the tree
        already caches; returns the slots the caller must free instead of those duplicates.

        ``token_ids`` must be cached as a whole, with node boundaries at ``start`` and at its
        end: right after ``n = insert(...)``, pass the inserted tokens up to ``n`` and the
        caller's ``cached_len`` as ``start``. Every node of ``[start, len)`` that no request
        locks (no one reads its slots) and for which ``prefer(node_slots, offered_slots)``
        takes the offered slots, and the caller frees the node's old ones; elsewhere the caller
        frees its offered slots as with a plain ``insert``. Either way each position keeps one
        copy, so sizes and ownership stay as they were.
        """
        if self.disable:
            return np.asarray(kv_slots[start:], dtype=np.int32)
        key = np.asarray(token_ids, dtype=np.int32)
        value = np.asarray(kv_slots, dtype=np.int32)
        give_back: list[np.ndarray] = []
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self.child_key(key, pos))
            n = 0 if child is None else len(child.key)
            if child is None or not np.array_equal(child.key, key[pos : pos + n]):
                raise ValueError(f"positions [{pos}, {len(key)}) are not cached as whole nodes")
            if pos >= start:
                offered = value[pos : pos + n]
                if child.lock_ref == 0 and prefer(child.value, offered):
                    give_back.append(child.value)
                    child.value = offered.copy()
                else:
                    give_back.append(offered)
            elif pos + n > start:
                raise ValueError(f"position {start} is inside a node")
            node, pos = child, pos + n
        return np.concatenate(give_back) if give_back else _EMPTY.copy()

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` after its first ``n`` tokens (0 < n < len, whole pages); return the
        new parent.

        The new parent copies the child's lock_ref: every lock that covered the child covered
        all of its tokens, so it now covers both halves. Sizes are unchanged.
        """
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key) and n % self.page_size == 0
        head = TreeNode(child.key[:n], child.value[:n], parent, child.lock_ref,
                        child.last_access_time)
        parent.children[self.child_key(head.key)] = head
        child.key, child.value, child.parent = child.key[n:], child.value[n:], head
        head.children[self.child_key(child.key)] = child
        return head

    # ---- locking -----------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (counted; pair with dec)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"{node!r} unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.key)
                self._evictable_size += len(node.key)
            assert node.parent is not None
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (whole pages) if possible, least recently used
        leaves first.

        Only unlocked leaves go; a parent left childless and unlocked becomes a candidate in
        turn. Whole nodes are freed, so more than ``num_tokens`` may be returned; fewer only
        when everything evictable is gone. Returns the number of slots freed.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.value)
            freed += len(leaf.value)
            self._evictable_size -= len(leaf.value)
            del parent.children[self.child_key(leaf.key)]
            leaf.parent = None
            if not parent.children and parent.lock_ref == 0:  # the root's lock_ref is 1
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _nodes(self) -> list[TreeNode]:
        """All nodes except the root (iterative: long chains must not hit the recursion limit)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---- sizes and debugging -----------------------------------------------------------------

    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Slots held by locked nodes (in use by some request, or ancestors of those)."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def pretty_print(self) -> str:
        lines = [f"root (evictable={self._evictable_size}, protected={self._protected_size})"]
        stack = [(c, 1) for c in reversed(self.root.children.values())]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}{_preview(node.key)} -> {_preview(node.value)} "
                f"len={len(node.key)} lock={node.lock_ref} t={node.last_access_time}"
            )
            stack.extend((c, depth + 1) for c in reversed(node.children.values()))
        return "\n".join(lines)


def _preview(a: np.ndarray, n: int = 8) -> str:
    items = [str(int(x)) for x in a[:n]]
    return "[" + " ".join(items) + (" ...]" if len(a) > n else "]")
