"""Paged KV memory on the host: the page allocator, the page-granular radix tree and ReqMemory.

The invariant under test (the device page table relies on it): for every request, positions
``[i*P, (i+1)*P)`` live in one page at offsets ``0 .. P-1``; a page has one owner at a time;
nothing leaks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.managers.req_memory import ReqMemory
from sgl_jax.srt.managers.request_options import RequestOptions
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.testing import TEST_MODEL_PATH
from tests.test_radix_cache import assert_paged, check_invariants, drain, run_request

# -- the allocator ------------------------------------------------------------------------------


def test_geometry_and_bad_arguments() -> None:
    alloc = TokenToKVPoolAllocator(32, page_size=4)
    assert (alloc.num_pages, alloc.num_slots, alloc.available_size()) == (8, 36, 32)
    assert sorted(alloc.free_pages().tolist()) == list(range(1, 9))  # page 0 is padding
    assert TokenToKVPoolAllocator(7).num_slots == 8  # page_size 1: slots 1..7 + padding
    with pytest.raises(ValueError, match="multiple of page_size"):
        TokenToKVPoolAllocator(30, page_size=4)
    with pytest.raises(ValueError, match="power of two"):
        TokenToKVPoolAllocator(30, page_size=3)


def test_alloc_fills_the_partial_last_page_first() -> None:
    alloc = TokenToKVPoolAllocator(32, page_size=4)
    a = alloc.alloc(6)  # positions 0..5: two pages, the second half full
    assert_paged(a, 4)
    assert alloc.available_size() == 24 and (a > 3).all()
    b = alloc.alloc_extend(1, 6, int(a[-1]))  # position 6: the rest of that page, no new page
    assert b.tolist() == [a[-1] + 1] and alloc.available_size() == 24
    c = alloc.alloc_extend(6, 7, int(b[-1]))  # position 7 in the page, then 8..12: two pages
    assert c[0] == b[0] + 1 and alloc.available_size() == 16
    kv = np.concatenate([a, b, c])
    assert_paged(kv, 4)
    assert len(set((kv // 4).tolist())) == 4
    assert alloc.tokens_needed(13, 3) == 0 and alloc.tokens_needed(13, 4) == 4
    assert alloc.tokens_needed(0, 1) == 4 and alloc.tokens_needed(8, 9) == 12
    with pytest.raises(ValueError, match="cannot hold position"):
        alloc.alloc_extend(1, 13, int(kv[-1]) + 1)  # the wrong last slot
    assert alloc.available_size() == 16  # nothing taken by the bad call
    alloc.free(kv[:8])  # two whole pages
    alloc.free(kv[8:])  # and the partial tail page
    assert alloc.available_size() == 32


def test_exhaustion_returns_none_without_side_effects() -> None:
    alloc = TokenToKVPoolAllocator(16, page_size=4)
    a = alloc.alloc(10)  # 3 pages, 2 offsets of the last one free
    free = sorted(alloc.free_pages().tolist())
    assert alloc.alloc(5) is None  # 2 pages wanted, 1 free
    assert alloc.alloc_extend(7, 10, int(a[-1])) is None  # 2 in the last page + 2 pages
    assert alloc.alloc_decode(np.array([4, 8, 12]), np.array([7, 11, 15])) is None
    assert sorted(alloc.free_pages().tolist()) == free and alloc.available_size() == 4
    b = alloc.alloc_extend(6, 10, int(a[-1]))  # exactly fits: 2 in the page, then 1 page
    assert b is not None and alloc.available_size() == 0
    assert alloc.alloc_extend(0, 16, int(b[-1])).size == 0  # nothing asked, nothing taken
    assert alloc.alloc(1) is None
    alloc.free(np.concatenate([a, b]))
    assert alloc.available_size() == 16


def test_free_rules_and_double_free() -> None:
    alloc = TokenToKVPoolAllocator(16, page_size=4)
    kv = alloc.alloc(6)
    alloc.free(kv[4:])  # the partial tail page alone
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(kv[4:5])
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(np.array([1, 2], dtype=np.int32))  # the padding page
    alloc.free(kv[:4])
    assert alloc.available_size() == 16
    with pytest.raises(RuntimeError):
        alloc.free(kv[:4])
    one = TokenToKVPoolAllocator(4)  # page_size 1 checks too
    s = one.alloc(2)
    one.free(s)
    with pytest.raises(RuntimeError):
        one.free(s[:1])


def test_alloc_decode_matches_one_by_one() -> None:
    alloc = TokenToKVPoolAllocator(64, page_size=4)
    lens = [1, 4, 7, 8, 2]
    kvs = [alloc.alloc(n) for n in lens]
    before = alloc.available_size()
    kv_lens = np.array(lens)
    last = np.array([kv[-1] for kv in kvs])
    assert alloc.decode_tokens_needed(kv_lens) == 8  # the requests at 4 and 8 need pages
    slots = alloc.alloc_decode(kv_lens, last)
    assert before - alloc.available_size() == 8 and slots.dtype == np.int32
    pages = set()
    for kv, s in zip(kvs, slots, strict=True):
        full = np.concatenate([kv, [s]])
        assert_paged(full, 4)
        mine = set((full // 4).tolist())
        assert not (mine & pages)  # pages are never shared between requests
        pages |= mine
    one = TokenToKVPoolAllocator(8)
    assert len(set(one.alloc_decode(np.array([3, 5, 1]), None).tolist())) == 3
    assert one.available_size() == 5


@pytest.mark.parametrize("page", [1, 4, 16])
def test_random_requests_never_share_pages_and_never_leak(page: int) -> None:
    rng = random.Random(page)
    alloc = TokenToKVPoolAllocator(48 * page, page_size=page)
    reqs: list[np.ndarray] = []
    for _ in range(500):
        op = rng.random()
        if op < 0.3:  # a new request's first chunk
            kv = alloc.alloc(rng.randint(1, 3 * page))
            if kv is not None:
                reqs.append(kv)
        elif op < 0.5 and reqs:  # another chunk of one request
            i = rng.randrange(len(reqs))
            kv = reqs[i]
            more = alloc.alloc_extend(rng.randint(0, 2 * page), len(kv), int(kv[-1]))
            if more is not None:
                reqs[i] = np.concatenate([kv, more])
        elif op < 0.8 and reqs:  # a decode step of all of them
            before = alloc.available_size()
            kv_lens = np.array([len(kv) for kv in reqs])
            slots = alloc.alloc_decode(kv_lens, np.array([kv[-1] for kv in reqs]))
            if slots is None:
                assert alloc.available_size() == before
                assert alloc.decode_tokens_needed(kv_lens) > before
            else:
                reqs = [np.concatenate([kv, [s]]) for kv, s in zip(reqs, slots, strict=True)]
        elif reqs:  # one finishes: whole pages, then its partial tail page
            kv = reqs.pop(rng.randrange(len(reqs)))
            aligned = len(kv) - len(kv) % page
            alloc.free(kv[:aligned])
            alloc.free(kv[aligned:])
        owned: set[int] = set()
        for kv in reqs:
            assert_paged(kv, page)
            pages = set((kv // page).tolist())
            assert not (pages & owned) and 0 not in pages
            owned |= pages
        free = set(alloc.free_pages().tolist())
        assert not (free & owned) and free | owned == set(range(1, 49))
    for kv in reqs:
        alloc.free(kv)
    assert alloc.available_size() == alloc.size


# -- the page-granular radix tree ---------------------------------------------------------------


@pytest.fixture
def cache() -> RadixCache:
    return RadixCache(TokenToKVPoolAllocator(64, page_size=4), page_size=4)


def test_page_size_must_match_the_allocator() -> None:
    with pytest.raises(ValueError, match="page_size=4"):
        RadixCache(TokenToKVPoolAllocator(64), page_size=4)
    assert RadixCache(TokenToKVPoolAllocator(64, page_size=4)).page_size == 4


def test_insert_keeps_whole_pages_and_match_returns_whole_pages(cache: RadixCache) -> None:
    alloc = cache.allocator
    tokens = list(range(10, 20))  # 10 tokens: two pages and a tail of two
    kv = alloc.alloc(10)
    assert cache.insert(tokens, kv) == 0
    alloc.free(kv[8:])  # the caller frees the unaligned tail
    assert cache.total_size() == 8 and alloc.available_size() == 56
    for query, n in [(tokens, 8), (tokens[:9], 8), (tokens[:7], 4), (tokens[:4], 4),
                     (tokens[:3], 0), (tokens[:6] + [0, 0, 0, 0], 4), ([], 0)]:
        slots, node = cache.match_prefix(query)
        np.testing.assert_array_equal(slots, kv[:n])
        assert (node is cache.root) == (n == 0)
        check_invariants(cache, alloc)
    # The match of 6 tokens split the node at the page boundary only: [10..13] [14..17].
    (head,) = cache.root.children.values()
    assert len(head.key) == 4 and [len(c.key) for c in head.children.values()] == [4]
    drain(cache, alloc)


def test_children_sharing_a_first_token_coexist(cache: RadixCache) -> None:
    alloc = cache.allocator
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 5, 6, 7, 8]  # differ inside the first page
    assert run_request(cache, alloc, a) == 0
    assert run_request(cache, alloc, b) == 0  # nothing shared: no whole page in common
    assert len(cache.root.children) == 2
    sa, sb = cache.match_prefix(a)[0], cache.match_prefix(b)[0]
    assert len(sa) == len(sb) == 8 and not set(sa.tolist()) & set(sb.tolist())
    assert len(cache.match_prefix([1, 2, 3, 9])[0]) == 0
    c = [1, 2, 3, 4, 5, 6, 0, 0, 0]  # shares a's first page, then differs inside the second
    assert run_request(cache, alloc, c) == 4
    (node_a,) = [n for n in cache.root.children.values() if n.key[2] == 3]
    assert len(node_a.key) == 4 and len(node_a.children) == 2
    check_invariants(cache, alloc)
    drain(cache, alloc)


def test_eviction_frees_whole_pages_and_respects_locks(cache: RadixCache) -> None:
    alloc = cache.allocator
    run_request(cache, alloc, list(range(12)))
    run_request(cache, alloc, list(range(8)) + [50] * 5)  # a sibling page under [0..7]
    assert cache.total_size() == 16
    slots, node = cache.match_prefix(list(range(12)))
    cache.inc_lock_ref(node)
    assert cache.evict(1) == 4  # asked for one slot, a whole page went
    assert cache.evict(100) == 0  # the rest is locked
    np.testing.assert_array_equal(cache.match_prefix(list(range(12)))[0], slots)
    cache.dec_lock_ref(node)
    check_invariants(cache, alloc)
    drain(cache, alloc)


# -- ReqMemory: admission, allocation and release in pages -----------------------------------


def _memory(page: int, size: int = 64, capture: bool = False) -> ReqMemory:
    alloc = TokenToKVPoolAllocator(size, page_size=page)
    cfg = ModelConfig.from_hf(TEST_MODEL_PATH)
    rows = RoutedExpertsHostCache(alloc.num_slots, cfg.num_hidden_layers,
                                  cfg.num_experts_per_tok, cfg.num_experts) if capture else None
    return ReqMemory(ReqToTokenPool(4, 64), alloc, RadixCache(alloc, page_size=page), rows)


def _req(ids: list[int], capture: bool = False) -> Req:
    return Req(rid=str(ids[:3]), origin_input_ids=list(ids),
               sampling_params=SamplingParams(max_new_tokens=8), seed=0,
               options=RequestOptions(return_routed_experts=capture))


def _prefill(mem: ReqMemory, req: Req, chunk: int) -> None:
    """Admits and computes the whole prompt in chunks, the way the scheduler does."""
    assert mem.admit(req)
    while req.kv_len < req.seq_len:
        n = min(chunk, req.seq_len - req.kv_len)
        before = mem.allocator.available_size()
        slots = mem.alloc_kv(req, n)
        assert before - mem.allocator.available_size() == mem.kv_needed(req.kv_len, n)
        mem.assign_kv(req, slots)
        req.kv_len += n


def _row(mem: ReqMemory, req: Req) -> np.ndarray:
    return mem.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len]


def _leak_free(mem: ReqMemory) -> None:
    stats = mem.stats()
    assert stats["locked_kv_slots"] == 0
    assert stats["available_kv_slots"] + stats["evictable_kv_slots"] == stats["total_kv_slots"]
    assert stats["free_req_slots"] == stats["total_req_slots"]


def test_req_memory_prefill_decode_release_in_pages() -> None:
    mem = _memory(4)
    prompt = list(range(100, 111))  # 11 tokens
    a = _req(prompt)
    _prefill(mem, a, chunk=5)  # chunks of 5 end inside pages: the next one fills them
    assert a.prefix_len == 0 and a.cached_tokens == 0
    b = _req(prompt[:6] + [7, 7, 7])
    _prefill(mem, b, chunk=64)
    for step in range(6):  # decode both; a crosses page boundaries at 12 and 16
        slots = mem.alloc_decode_kv([a, b])
        for req, s in zip((a, b), slots, strict=True):
            assert mem.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_len] == s
            req.kv_len += 1
            req.output_ids.append(200 + step)
    ra, rb = _row(mem, a), _row(mem, b)
    assert_paged(ra, 4)
    assert_paged(rb, 4)
    assert not set((ra // 4).tolist()) & set((rb // 4).tolist())
    mem.release(a)  # 17 positions: the tree takes 16, the tail page goes back
    assert mem.tree.total_size() == 16
    mem.release(b)  # 15 positions: 12 aligned, its first page [100..103] is a's: a duplicate
    assert mem.tree.total_size() == 16 + 8
    _leak_free(mem)

    # A request with the same prompt reuses whole pages only: 8 of its 10 usable tokens.
    c = _req(prompt)
    assert mem.admit(c)
    assert c.prefix_len == c.kv_len == c.cached_tokens == 8
    np.testing.assert_array_equal(_row(mem, c), ra[:8])
    mem.release(c, cache=False)
    _leak_free(mem)
    mem.flush()
    assert mem.allocator.available_size() == 64


def test_routed_experts_validity_rounds_down_to_whole_pages() -> None:
    mem = _memory(4, capture=True)
    prompt = list(range(300, 313))
    a = _req(prompt)
    _prefill(mem, a, chunk=64)
    host = mem.routed_rows
    row = _row(mem, a)
    host.set_valid(row, True)
    host.set_valid(row[6:7], False)  # position 6: its row is unknown
    mem.release(a)
    b = _req(prompt, capture=True)
    assert mem.admit(b)
    assert b.prefix_len == 4  # 6 valid positions -> one whole page
    mem.release(b)
    c = _req(prompt)  # without routed experts the whole cached 12 are reused
    assert mem.admit(c) and c.prefix_len == 12
    mem.release(c)
    _leak_free(mem)


def test_page_size_one_admission_and_release_unchanged() -> None:
    mem = _memory(1, size=32)
    prompt = list(range(11))
    a = _req(prompt)
    _prefill(mem, a, chunk=4)
    mem.release(a)
    assert mem.tree.total_size() == 11
    b = _req(prompt)
    assert mem.admit(b) and b.prefix_len == 10  # one token left to compute
    mem.release(b)
    _leak_free(mem)


# -- routed experts: a prefix cached without rows is replaced by a copy with rows -----------------


def _prefill_capturing(mem: ReqMemory, req: Req) -> None:
    """Prefills ``req`` in one step that captures rows, as a step in which a request asked."""
    _prefill(mem, req, chunk=64)
    mem.routed_rows.set_valid(_row(mem, req)[req.prefix_len :], True)


@pytest.mark.parametrize("page", [1, 4])
def test_recomputed_prefix_with_rows_replaces_the_cached_one_without(page: int) -> None:
    mem = _memory(page, capture=True)
    prompt = list(range(400, 413))
    a = _req(prompt)  # did not ask: its KV's rows are unknown (invalid)
    _prefill(mem, a, chunk=64)
    old = _row(mem, a).copy()
    mem.release(a)
    b = _req(prompt, capture=True)  # asks: cannot reuse a's KV, recomputes it
    _prefill_capturing(mem, b)
    assert b.cached_tokens == 0
    new = _row(mem, b).copy()
    mem.release(b)
    aligned = (len(prompt) // page) * page
    cached, node = mem.tree.match_prefix(prompt)
    np.testing.assert_array_equal(cached, new[:aligned])  # the tree now holds b's copies
    assert not set(old[:aligned].tolist()) & set(cached.tolist())
    c = _req(prompt, capture=True)  # asks: reuses the whole usable prefix, rows and all
    assert mem.admit(c)
    assert c.cached_tokens == ((len(prompt) - 1) // page) * page > 0
    mem.release(c)
    _leak_free(mem)
    mem.flush()
    assert mem.allocator.available_size() == 64


def test_a_prefix_in_use_is_not_replaced() -> None:
    mem = _memory(1, capture=True)
    prompt = list(range(500, 510))
    a = _req(prompt)
    _prefill(mem, a, chunk=64)
    old = _row(mem, a).copy()
    mem.release(a)
    reader = _req(prompt)  # does not ask: reads a's cached KV, locking it
    assert mem.admit(reader) and reader.prefix_len == 9
    b = _req(prompt, capture=True)
    _prefill_capturing(mem, b)
    mem.release(b)  # a's first 9 slots are being read: the tree keeps them, frees b's copies
    np.testing.assert_array_equal(mem.tree.match_prefix(prompt)[0][:9], old[:9])
    mem.release(reader, cache=False)
    b2 = _req(prompt, capture=True)  # unlocked now: this time its copies replace a's
    _prefill_capturing(mem, b2)
    new = _row(mem, b2).copy()
    mem.release(b2)
    cached = mem.tree.match_prefix(prompt)[0]
    np.testing.assert_array_equal(cached[:9], new[:9])  # position 9 already had b's (rows)
    assert mem.routed_rows.all_valid(cached)
    _leak_free(mem)
