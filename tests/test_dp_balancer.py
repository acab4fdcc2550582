"""The DP attention rank of a new request (dp_balancer) and the per-rank memory (RankedMemory):
host logic only, no JAX."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax.srt.managers.dp_balancer import DPBalancer, RankCounts, RankLoad
from sgl_jax.srt.managers.req_memory import RankedMemory, ReqMemory
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.sampling.sampling_params import SamplingParams

NO_CACHE = [0, 0, 0]


def test_round_robin_takes_ranks_in_turn():
    b = DPBalancer("round_robin", 3)
    assert not b.needs_loads
    assert [b.choose(NO_CACHE) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_takes_the_fewest_requests_ties_to_the_lowest_rank():
    b = DPBalancer("shortest_queue", 3)
    loads = [RankLoad(2, 0), RankLoad(1, 500), RankLoad(1, 10)]
    assert b.choose(NO_CACHE, loads) == 1
    assert b.choose(NO_CACHE, [RankLoad(0, 9), RankLoad(0, 0), RankLoad(3, 0)]) == 0


def test_minimum_tokens_takes_the_fewest_tokens():
    b = DPBalancer("minimum_tokens", 3)
    assert b.choose(NO_CACHE, [RankLoad(0, 40), RankLoad(5, 30), RankLoad(1, 31)]) == 1
    assert b.choose(NO_CACHE, [RankLoad(0, 7), RankLoad(5, 7), RankLoad(1, 8)]) == 0


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue", "minimum_tokens"])
def test_the_longest_cached_prefix_wins_whatever_the_load(method):
    b = DPBalancer(method, 3)
    loads = [RankLoad(0, 0), RankLoad(0, 0), RankLoad(9, 900)]
    assert b.choose([4, 0, 16], loads) == 2
    assert b.choose([0, 8, 0], loads) == 1


def test_a_tie_of_cached_prefixes_is_broken_by_the_method():
    loads = [RankLoad(3, 0), RankLoad(1, 0), RankLoad(0, 0)]
    # Ranks 0 and 1 cache 8 tokens; rank 2 is the least loaded but caches nothing.
    assert DPBalancer("shortest_queue", 3).choose([8, 8, 0], loads) == 1
    rr = DPBalancer("round_robin", 3)
    assert rr.choose(NO_CACHE) == 0  # the turn moves to rank 1
    assert rr.choose([8, 0, 8]) == 2  # the first tied rank from rank 1 on
    assert rr.choose(NO_CACHE) == 0  # and the turn moved past it


def test_rank_counts_and_loads():
    running = [_req("a", [1] * 5, 1), _req("b", [1] * 7, 1)]
    waiting = [_req("c", [1] * 9, 0), _req("d", [1] * 4, 1)]
    waiting[0].kv_len = 0
    counts = RankCounts.of(2, running, waiting)
    assert (counts.running, counts.waiting, counts.waiting_tokens) == ([0, 2], [1, 1], [9, 4])
    assert counts.loads([3, 20]) == [RankLoad(1, 12), RankLoad(3, 24)]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="load balance method"):
        DPBalancer("random", 2)
    with pytest.raises(ValueError, match="needs the load"):
        DPBalancer("minimum_tokens", 2).choose([0, 0])
    with pytest.raises(ValueError, match="cached lengths"):
        DPBalancer("round_robin", 2).choose([0, 0, 0])


def test_cached_prefix_len_reads_without_splitting_or_touching():
    alloc = TokenToKVPoolAllocator(64, page_size=4)
    tree = RadixCache(alloc, page_size=4)
    tokens = list(range(100, 112))
    tree.insert(tokens, alloc.alloc(12))
    before = tree.pretty_print()
    assert tree.cached_prefix_len(tokens + [1, 2]) == 12
    assert tree.cached_prefix_len(tokens[:9]) == 8  # whole pages only
    assert tree.cached_prefix_len(tokens[:6] + [0] * 6) == 4
    assert tree.cached_prefix_len([7] * 12) == 0
    assert tree.pretty_print() == before  # no split, no access time changed
    slots, _ = tree.match_prefix(tokens[:6] + [0] * 6)
    assert len(slots) == 4  # the same answer as the mutating lookup


def _req(rid: str, ids: list[int], rank: int) -> Req:
    params = SamplingParams.from_dict({"max_new_tokens": 4})
    params.normalize()
    return Req(rid=rid, origin_input_ids=ids, sampling_params=params, seed=0, dp_rank=rank)


def _ranked(page: int = 4, rank_tokens: int = 32, dp: int = 2) -> RankedMemory:
    pool = ReqToTokenPool(4, 64)
    pages = rank_tokens // page + 1
    allocs = [TokenToKVPoolAllocator(rank_tokens, page, first_page=r * pages) for r in range(dp)]
    return RankedMemory([ReqMemory(pool, a, RadixCache(a, page_size=page)) for a in allocs])


def test_ranked_memory_keeps_each_request_in_its_rank_and_sums_stats():
    mem = _ranked()
    a, b = _req("a", list(range(10)), 0), _req("b", list(range(10)), 1)
    for req in (a, b):
        assert mem.of(req).admit(req)
        slots = mem.of(req).alloc_kv(req, 10)
        mem.of(req).assign_kv(req, slots)
        req.kv_len = 10
    pages_b = mem.req_to_token_pool.req_to_token[b.req_pool_idx, :10] // 4
    pages_a = mem.req_to_token_pool.req_to_token[a.req_pool_idx, :10] // 4
    assert pages_a.min() >= 1 and pages_a.max() <= 8  # rank 0: pages 1..8 (0: padding)
    assert pages_b.min() >= 10 and pages_b.max() <= 17  # rank 1: pages 10..17 (9: padding)
    stats = mem.stats()
    assert stats["total_kv_slots"] == 64 and stats["available_kv_slots"] == 64 - 24
    assert stats["total_req_slots"] == 4 and stats["free_req_slots"] == 2
    assert mem.rank_stats(1)["available_kv_slots"] == 32 - 12
    assert mem[0].held_kv() == 12
    for req in (a, b):
        mem.release(req, cache=True)
    # Each rank's tree caches its own copy (the aligned 8 tokens); the other rank's is empty.
    assert [m.tree.cached_prefix_len(list(range(10))) for m in mem.ranks] == [8, 8]
    assert mem.stats()["evictable_kv_slots"] == 16
    mem.flush()
    assert mem.stats()["available_kv_slots"] == 64
    assert np.all(mem[1].allocator.free_pages() >= 10)
