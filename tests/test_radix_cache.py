"""Radix cache against the real KV allocator: invariants, LRU, locks, splits, no leaks.

The helpers and the randomized model check work with any page size (see also
tests/test_paged_memory.py for the paged specifics).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgl_jax.srt.mem_cache.memory_pool import TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache, TreeNode

POOL = 64


def _nodes(cache: RadixCache) -> list[TreeNode]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def page_slots(pages, page_size: int) -> set[int]:
    """Every slot of the given pages."""
    return {int(p) * page_size + o for p in pages for o in range(page_size)}


def _free_slots(alloc: TokenToKVPoolAllocator) -> set[int]:
    return page_slots(alloc.free_pages(), alloc.page_size)


def assert_paged(slots: np.ndarray, page_size: int, start: int = 0) -> None:
    """``slots`` of positions ``start ..``: position i at offset i % P of one page per P."""
    pos = np.arange(start, start + len(slots))
    assert (slots % page_size == pos % page_size).all(), slots
    page = slots // page_size
    first = np.flatnonzero(pos % page_size == 0)
    for a, b in zip(first, list(first[1:]) + [len(slots)], strict=True):
        assert (page[a:b] == page[a]).all(), slots


def check_invariants(
    cache: RadixCache, alloc: TokenToKVPoolAllocator, outside: set[int] | None = None
) -> set[int]:
    """Structure, size counters and slot ownership; ``outside`` = slots requests hold (their
    partly filled last pages count as whole pages)."""
    page = alloc.page_size
    tree_slots: list[int] = []
    evictable = protected = 0
    for node in _nodes(cache):
        assert len(node.key) == len(node.value) > 0 and len(node.key) % page == 0
        assert_paged(node.value, page)
        parent = node.parent
        assert parent is not None and parent.children[cache.child_key(node.key)] is node
        if parent is not cache.root:
            assert parent.lock_ref >= node.lock_ref  # ancestors of a locked node are locked
        assert node.lock_ref >= 0
        tree_slots += [int(s) for s in node.value]
        if node.lock_ref:
            protected += len(node.value)
        else:
            evictable += len(node.value)
    assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)
    assert cache.total_size() == evictable + protected == len(tree_slots)
    held = set(tree_slots)
    assert len(held) == len(tree_slots), "a slot is held twice by the tree"
    outside = page_slots({s // page for s in outside or set()}, page)
    free = _free_slots(alloc)
    assert not (held & free) and not (held & outside) and not (free & outside)
    assert held | free | outside == set(range(page, alloc.num_slots)), "slot leaked"
    return held


def run_request(cache: RadixCache, alloc: TokenToKVPoolAllocator, tokens: list[int]) -> int:
    """A whole request the way the scheduler does it; returns the insert result."""
    cached, node = cache.match_prefix(tokens)
    cache.inc_lock_ref(node)
    own = alloc.alloc_extend(len(tokens) - len(cached), len(cached))
    assert own is not None
    kv = np.concatenate([cached, own])
    assert_paged(kv, alloc.page_size)
    n = cache.insert(tokens, kv)
    aligned = len(tokens) - len(tokens) % alloc.page_size
    alloc.free(kv[len(cached) : n])  # the caller-free rule: duplicates...
    alloc.free(kv[aligned:])  # ...and the unaligned tail
    cache.dec_lock_ref(node)
    return n


def drain(cache: RadixCache, alloc: TokenToKVPoolAllocator) -> None:
    cache.evict(cache.total_size() + 1)
    assert cache.total_size() == 0
    assert alloc.available_size() == alloc.size


@pytest.fixture
def cache() -> RadixCache:
    return RadixCache(TokenToKVPoolAllocator(POOL))


def test_disabled_cache_holds_nothing() -> None:
    alloc = TokenToKVPoolAllocator(POOL)
    cache = RadixCache(alloc, disable=True)
    kv = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], kv) == 0
    slots, node = cache.match_prefix([1, 2, 3, 4])
    assert len(slots) == 0 and slots.dtype == np.int32 and node is cache.root
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    assert cache.evict(10) == 0 and cache.total_size() == 0
    alloc.free(kv)  # disabled: the caller owns every slot it inserted
    assert alloc.available_size() == POOL


def test_match_after_insert_returns_the_right_slots(cache: RadixCache) -> None:
    alloc = cache.allocator
    kv = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], kv) == 0
    for query, n in [([1, 2, 3, 4, 5, 6, 7], 5), ([1, 2, 3, 4, 5], 5), ([1, 2, 3], 3),
                     ([1, 2, 9], 2), ([1], 1), ([7, 1], 0), ([], 0)]:
        slots, node = cache.match_prefix(query)
        np.testing.assert_array_equal(slots, kv[:n])
        assert slots.dtype == np.int32
        assert (node is cache.root) == (n == 0)
        check_invariants(cache, alloc)
    # matched [1,2,3] then [1] and [1,2]: the one edge is now [1] [2] [3] [4 5]
    lens = []
    node = cache.root
    while node.children:
        (node,) = node.children.values()
        lens.append(len(node.key))
    assert lens == [1, 1, 1, 2]
    drain(cache, alloc)


def test_split_in_the_middle_keeps_slots_and_locks(cache: RadixCache) -> None:
    alloc = cache.allocator
    kv = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], kv)
    _, leaf = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(leaf)
    cache.inc_lock_ref(leaf)
    assert cache.protected_size() == 6 and cache.evictable_size() == 0

    slots, head = cache.match_prefix([1, 2, 3, 9])  # diverges inside the locked node
    np.testing.assert_array_equal(slots, kv[:3])
    assert head.lock_ref == 2 and leaf.lock_ref == 2 and leaf.parent is head
    np.testing.assert_array_equal(head.value, kv[:3])
    np.testing.assert_array_equal(leaf.value, kv[3:])
    np.testing.assert_array_equal(leaf.key, [4, 5, 6])
    check_invariants(cache, alloc)

    # A sibling under the split point, inserted while the path is locked, is itself evictable.
    assert run_request(cache, alloc, [1, 2, 3, 7, 8]) == 3
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    np.testing.assert_array_equal(cache.match_prefix([1, 2, 3, 4, 5, 6])[0], kv)

    cache.dec_lock_ref(leaf)
    assert cache.evict(100) == 0  # still locked once
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    check_invariants(cache, alloc)
    drain(cache, alloc)


def test_duplicate_insert_and_caller_free_rule(cache: RadixCache) -> None:
    alloc = cache.allocator
    prompt = [5, 6, 7, 8]
    # Two requests with the same prompt run concurrently; neither finds a cached prefix.
    reqs = []
    for _ in range(2):
        cached, node = cache.match_prefix(prompt)
        cache.inc_lock_ref(node)
        reqs.append((cached, node, alloc.alloc(len(prompt) - len(cached))))
    (c1, n1, own1), (c2, n2, own2) = reqs
    assert len(c1) == len(c2) == 0
    assert cache.insert(prompt, own1) == 0  # first one donates all its slots
    assert cache.insert(prompt, own2) == 4  # second one's are all duplicates
    alloc.free(own2[0:4])
    cache.dec_lock_ref(n1)
    cache.dec_lock_ref(n2)
    check_invariants(cache, alloc)

    # A request that hit 2 tokens, then found 4 cached by the time it finished, extends by 2.
    cached, node = cache.match_prefix([5, 6])
    cache.inc_lock_ref(node)
    kv = np.concatenate([cached, alloc.alloc(4)])
    assert cache.insert([5, 6, 7, 8, 9, 10], kv) == 4
    alloc.free(kv[2:4])  # [cached_len, returned): NOT kv[:4], slots 0..1 are the tree's
    cache.dec_lock_ref(node)
    np.testing.assert_array_equal(cache.match_prefix([5, 6, 7, 8, 9, 10])[0],
                                  np.concatenate([own1, kv[4:]]))
    check_invariants(cache, alloc)
    assert cache.insert([5, 6], own1[:2]) == 2  # re-inserting a cached prefix changes nothing
    check_invariants(cache, alloc)
    drain(cache, alloc)


def test_lru_eviction_order(cache: RadixCache) -> None:
    alloc = cache.allocator
    run_request(cache, alloc, [1, 1, 1])  # oldest
    run_request(cache, alloc, [2, 2])
    run_request(cache, alloc, [3, 3, 3, 3])
    cache.match_prefix([1, 1, 1])  # now the most recently used
    assert cache.evict(1) == 2  # [2 2]: whole nodes go, so more than asked may be freed
    assert len(cache.match_prefix([2, 2])[0]) == 0
    assert cache.evict(3) == 4  # [3 3 3 3]
    # A match ending inside a node refreshes only the split-off head, not the tail.
    cache.match_prefix([1, 1])
    run_request(cache, alloc, [4])
    assert cache.evict(1) == 1  # the tail [1] is older than [4]
    np.testing.assert_array_equal(cache.match_prefix([1, 1, 1])[1].key, [1, 1])
    check_invariants(cache, alloc)
    drain(cache, alloc)


def test_parent_becomes_evictable_after_its_children(cache: RadixCache) -> None:
    alloc = cache.allocator
    run_request(cache, alloc, [1, 2, 3, 4])
    run_request(cache, alloc, [1, 2, 5, 6])  # splits: [1 2] -> {[3 4], [5 6]}
    run_request(cache, alloc, [9])
    cache.match_prefix([9])
    # Both children of [1 2] are older than [9]; once they go, [1 2] (touched with them) goes
    # before [9] although it was never a leaf when eviction started.
    assert cache.evict(6) == 6
    assert len(cache.match_prefix([1])[0]) == 0 and len(cache.match_prefix([9])[0]) == 1
    drain(cache, alloc)


def test_locked_nodes_and_ancestors_are_never_evicted(cache: RadixCache) -> None:
    alloc = cache.allocator
    run_request(cache, alloc, [1, 2, 3, 4, 5])
    run_request(cache, alloc, [1, 2, 3, 6])
    run_request(cache, alloc, [7, 8])
    kv, node = cache.match_prefix([1, 2, 3, 4])  # splits [4 5] into [4] [5]
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4
    freed = cache.evict(POOL)
    assert freed == 1 + 1 + 2  # [5], [6], [7 8]
    assert cache.total_size() == cache.protected_size() == 4
    np.testing.assert_array_equal(cache.match_prefix([1, 2, 3, 4, 5])[0], kv)
    check_invariants(cache, alloc)
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    drain(cache, alloc)


def test_bad_input_and_reset(cache: RadixCache) -> None:
    alloc = cache.allocator
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], np.array([1, 2], dtype=np.int32))
    assert cache.insert([], np.zeros(0, dtype=np.int32)) == 0
    run_request(cache, alloc, [1, 2, 3])
    text = cache.pretty_print()
    assert "[1 2 3]" in text and "lock=0" in text
    cache.reset()  # forgets the tree; the allocator is the caller's to clear
    assert cache.total_size() == 0 and len(cache.match_prefix([1, 2, 3])[0]) == 0
    assert alloc.available_size() == POOL - 3
    alloc.clear()
    check_invariants(cache, alloc)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_randomized_against_brute_force_model(page: int) -> None:
    rng = random.Random(1234 * page)
    alloc = TokenToKVPoolAllocator(120 if page == 1 else 40 * page, page_size=page)
    cache = RadixCache(alloc, page_size=page)
    # Model: every cached prefix of whole pages (tuple) -> the slots of its last page.
    # Prefix-closed.
    model: dict[tuple[int, ...], tuple[int, ...]] = {}
    running: list[tuple[list[int], int, TreeNode, np.ndarray]] = []  # requests in flight
    locks: list[tuple[list[int], int, TreeNode]] = []  # bare locks on matched prefixes

    # With pages, random sequences rarely share whole pages: draw most as prefixes of a few
    # related bases (one differs from the first inside its first page, one after two pages),
    # sometimes with a token changed.
    b0 = [rng.randrange(3) for _ in range(6 * page)]
    b1 = b0[: page // 2] + [3] + b0[page // 2 + 1 :]
    b2 = b0[: 2 * page + 1] + [3] + b0[2 * page + 2 :]
    bases = [b0, b1, b2, [rng.randrange(3) for _ in range(6 * page)]]

    def rand_seq() -> list[int]:
        if page == 1 or rng.random() < 0.2:
            return [rng.randrange(3) for _ in range(rng.randint(1, 10 * page))]
        seq = list(rng.choice(bases)[: rng.randint(1, 6 * page)])
        if rng.random() < 0.4:
            seq[rng.randrange(len(seq))] = 4
        return seq

    def model_match(seq: list[int]) -> list[int]:
        """Slots of the longest cached prefix (whole pages)."""
        out: list[int] = []
        for end in range(page, len(seq) + 1, page):
            if tuple(seq[:end]) not in model:
                break
            out += model[tuple(seq[:end])]
        return out

    def locked_slots() -> set[int]:
        held = [(s, n) for s, n, *_ in running] + [(s, n) for s, n, _ in locks]
        return {x for s, n in held for end in range(page, n + 1, page)
                for x in model[tuple(s[:end])]}

    def evict(n: int) -> int:
        before, protected = alloc.available_size(), locked_slots()
        evictable = cache.evictable_size()
        freed = cache.evict(n)
        assert freed == alloc.available_size() - before
        assert freed >= min(n, evictable)
        gone = page_slots(alloc.free_pages()[before // page :], page)
        assert not (gone & protected)
        for prefix in [p for p, s in model.items() if s[0] in gone]:
            assert set(model.pop(prefix)) <= gone  # whole pages go
        assert all(p[:-page] in model for p in model if len(p) > page), "a non-leaf was evicted"
        return freed

    for _ in range(400):
        op = rng.random()
        if op < 0.35:  # a request arrives: match, lock, allocate the rest in two steps
            seq = rand_seq()
            cached, node = cache.match_prefix(seq)
            assert cached.tolist() == model_match(seq)
            cache.inc_lock_ref(node)
            need = len(seq) - len(cached)
            want = alloc.tokens_needed(len(cached), need)
            if alloc.available_size() < want:
                evict(want - alloc.available_size())
            first = rng.randint(0, need)  # the second part fills the first's last page
            kv = cached
            for n in (first, need - first):
                before = alloc.available_size()
                own = alloc.alloc_extend(n, len(kv), int(kv[-1]) if len(kv) else -1)
                if own is None:
                    assert alloc.available_size() == before  # nothing taken
                    alloc.free(kv[len(cached) :])
                    cache.dec_lock_ref(node)
                    break
                assert before - alloc.available_size() == alloc.tokens_needed(len(kv), n)
                kv = np.concatenate([kv, own])
            else:
                assert_paged(kv, page)
                running.append((seq, len(cached), node, kv))
        elif op < 0.65 and running:  # a request finishes: insert, free the rest, unlock
            seq, cached_len, node, kv = running.pop(rng.randrange(len(running)))
            expect = len(model_match(seq))
            aligned = len(seq) - len(seq) % page
            n = cache.insert(seq, kv)
            assert n == expect and n >= cached_len and n % page == 0
            for end in range(n + page, aligned + 1, page):
                model[tuple(seq[:end])] = tuple(int(x) for x in kv[end - page : end])
            alloc.free(kv[cached_len:n])  # duplicates
            alloc.free(kv[aligned:])  # the unaligned tail
            cache.dec_lock_ref(node)
        elif op < 0.75:
            seq = rand_seq()
            cached, node = cache.match_prefix(seq)
            assert cached.tolist() == model_match(seq)
            cache.inc_lock_ref(node)
            locks.append((seq, len(cached), node))
        elif op < 0.85 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks)))[2])
        else:
            evict(rng.randint(1, 20 * page))
        outside = {int(s) for _, c, _, kv in running for s in kv[c:]}
        held = check_invariants(cache, alloc, outside)
        assert held == {x for v in model.values() for x in v}
        assert len(held) == len(model) * page

    for _, cached_len, node, kv in running:
        alloc.free(kv[cached_len:])
        cache.dec_lock_ref(node)
    for _, _, node in locks:
        cache.dec_lock_ref(node)
    assert cache.protected_size() == 0
    drain(cache, alloc)
