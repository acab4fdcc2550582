"""Memory of requests in the scheduler: request slots, KV slots and the prefix cache.

Every KV slot a request holds is ``req_to_token[req.req_pool_idx, :req.kv_len]``; the first
``req.prefix_len`` of them belong to the radix tree (locked through ``req.last_node``), the
rest to the request. Releasing a request hands its own slots to the tree or back to the pool,
so that after every request is released the pool plus the tree's evictable slots are all the
slots there are.

Pages (``page_size`` P): KV is handed out in pages, and a request's positions ``[i*P,
(i+1)*P)`` share one page at offsets ``0 .. P-1`` (the device page table relies on it). The
cached prefix is whole pages, so a request's own slots start on a page boundary and its partly
filled last page is its own; on release the tree takes whole pages and the unaligned tail goes
back to the pool. Capacity is counted in tokens of whole pages: growing a request of ``kv_len``
positions by ``n`` takes ``allocator.tokens_needed(kv_len, n)``.

Routed experts (``routed_rows``, the host table of rows by slot, when enabled): a request that
asks reuses only the cached prefix whose rows are known, and recomputes the rest. When it is
released, its recomputed copies replace the tree's copies that lack rows (where no request is
reading them), so the next request that asks finds the prefix cached with its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.request_state import RequestStateTable
from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache


class ReqMemory:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree: RadixCache,
        routed_rows: RoutedExpertsHostCache | None = None,
        states: RequestStateTable | None = None,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree = tree
        self.routed_rows = routed_rows
        # Per-request auxiliary state (mem_cache/request_state.py), shared by the DP ranks
        # like the request slots; None when no kind of it is in use.
        self.states = states
        self.page_size = allocator.page_size

    # -- admission ------------------------------------------------------------------------------
    def available_kv(self) -> int:
        """Slots obtainable now (whole pages): free ones plus those the tree could evict."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def total_kv(self) -> int:
        """Slots of the whole KV cache (what one request could hold at most)."""
        return self.allocator.size

    def kv_needed(self, kv_len: int, n: int) -> int:
        """Of ``available_kv()``, what growing a request of ``kv_len`` positions by ``n`` takes."""
        return self.allocator.tokens_needed(kv_len, n)

    def admit(self, req: Req) -> bool:
        """Gives ``req`` a request slot, a state slot (when states are kept) and its longest
        usable cached prefix (locked)."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        if self.states is not None:
            req.state_slot = self.states.alloc()
            if req.state_slot is None:
                self.req_to_token_pool.free(idx)
                return False
        req.req_pool_idx = idx
        # At least one token must be computed: its logits sample the next token.
        usable = req.fill_ids[: req.seq_len - 1]
        if req.logprobs is not None:
            # Cached positions have no logits: input logprobs still to come are computed.
            limit = req.logprobs.cacheable_prefix(len(req.origin_input_ids))
            if limit is not None:
                usable = usable[:limit]
        slots, node = self.tree.match_prefix(usable)  # whole pages
        if req.options.return_routed_experts and self.routed_rows is not None:
            # Reuse only KV whose routed-experts rows were captured when it was computed.
            valid = self.routed_rows.valid_prefix_len(slots)
            valid -= valid % self.page_size
            if valid < len(slots):
                slots, node = self.tree.match_prefix(usable[:valid])
        self.tree.inc_lock_ref(node)
        req.last_node = node
        req.prefix_len = req.kv_len = len(slots)
        self.req_to_token_pool.write(idx, 0, slots)
        if not req.admitted:
            req.cached_tokens = len(slots)
            req.admitted = True
        return True

    def alloc_kv(self, req: Req, n: int) -> np.ndarray | None:
        """Slots for ``req``'s next ``n`` positions (evicting cached KV if needed), or None.

        They continue ``req``'s last page, then take new pages; record them with ``assign_kv``.
        """
        return self._alloc_from(req, req.kv_len, n)

    def extend_held_kv(self, req: Req, held: int, n: int) -> np.ndarray | None:
        """Slots for ``req``'s positions ``[held, held + n)``, past the ``held`` it holds
        already (a verify step launched while its predecessor is in flight: speculative/
        device_inputs.py), allocated AND recorded; None, with nothing taken, if they do not
        fit."""
        slots = self._alloc_from(req, held, n)
        if slots is not None:
            self.req_to_token_pool.write(req.req_pool_idx, held, slots)
        return slots

    def _alloc_from(self, req: Req, start: int, n: int) -> np.ndarray | None:
        """Slots for ``req``'s positions ``[start, start + n)``, continuing the page of
        position ``start - 1`` (evicting cached KV if needed), not recorded; or None."""
        short = self.allocator.tokens_needed(start, n) - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        last = -1
        if start % self.page_size:
            last = int(self.req_to_token_pool.req_to_token[req.req_pool_idx, start - 1])
        return self.allocator.alloc_extend(n, start, last)

    def alloc_decode_kv(self, reqs: list[Req]) -> np.ndarray | None:
        """One slot for each of ``reqs`` at its position ``kv_len``, allocated AND recorded
        (evicting cached KV if needed); None, with nothing taken, if they do not fit."""
        b = len(reqs)
        idx = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=b)
        kv_lens = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=b)
        short = self.allocator.decode_tokens_needed(kv_lens) - self.allocator.available_size()
        if short > 0:
            self.tree.evict(short)
        table = self.req_to_token_pool.req_to_token
        last = table[idx, kv_lens - 1] if self.page_size > 1 else None
        slots = self.allocator.alloc_decode(kv_lens, last)
        if slots is not None:
            table[idx, kv_lens] = slots
        return slots

    def decode_fits(self, reqs: list[Req]) -> bool:
        """Whether ``alloc_decode_kv(reqs)`` succeeds (evicting what it must): it takes
        nothing, so every rank of a decode step can be checked before any allocates."""
        kv_lens = np.fromiter((r.kv_len for r in reqs), dtype=np.int64, count=len(reqs))
        return self.allocator.decode_tokens_needed(kv_lens) <= self.available_kv()

    def held_kv(self) -> int:
        """Slots its requests hold now: neither free nor evictable from the tree."""
        return self.allocator.size - self.available_kv()

    def assign_kv(self, req: Req, slots: np.ndarray) -> None:
        """Records the slots of ``req``'s next ``len(slots)`` positions (not yet computed)."""
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)

    def shrink_kv(self, req: Req, kv_len: int, held: int | None = None,
                  reserve: int = 0) -> None:
        """Drops ``req``'s positions ``[kv_len + reserve, held)`` (rejected draft tokens, and
        EAGLE's scratch slots past ``req.kv_len``; ``held`` defaults to ``req.kv_len``): the
        pages past the one of position ``kv_len + reserve - 1`` go back; that page stays
        ``req``'s, and its later offsets are written again by the request's next tokens.
        ``reserve``: positions past ``kv_len`` a step in flight still uses (EAGLE's scratch)."""
        held = req.kv_len if held is None else held
        if kv_len < req.prefix_len or kv_len + reserve > held:
            raise ValueError(f"cannot keep {kv_len} positions of {req.rid} (prefix "
                             f"{req.prefix_len}, held {held})")
        keep = -(-(kv_len + reserve) // self.page_size) * self.page_size
        if keep < held:
            self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx,
                                                                    keep:held])
        req.kv_len = kv_len

    # -- routed experts -------------------------------------------------------------------------
    def routed_rows_of(
        self, req: Req, start: int | None = None, weights: bool = False, raw: bool = False
    ) -> np.ndarray:
        """``req``'s routed-experts rows ``[start, n)`` (``start``: its ``start_len`` unless
        given), n = the tokens whose routing has been computed for it (those with KV, at most
        ``seq_len - 1``); read before release. With ``weights``: their routing weights; with
        ``raw``: the ids in the host table's storage dtype (``gather(raw=True)``).

        The steps that computed them must all have been processed (their rows written): the
        scheduler settles a request's in-flight step before ending it out of turn (abort).
        """
        table = self.routed_rows
        assert table is not None, "routed experts are not enabled"
        end = 0 if req.req_pool_idx is None else min(req.kv_len, req.seq_len - 1)
        start = min(req.options.start_len if start is None else start, end)
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, start:end] if end else []
        slots = np.asarray(slots, dtype=np.int64)
        return table.gather_weights(slots) if weights else table.gather(slots, raw=raw)

    # -- release --------------------------------------------------------------------------------
    def release(self, req: Req, cache: bool = True) -> None:
        """Frees everything ``req`` holds; with ``cache``, its computed KV joins the tree."""
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].copy()
        if cache and not self.tree.disable:
            # The tree takes whole pages; the duplicates and the unaligned tail come back.
            aligned = req.kv_len - req.kv_len % self.page_size
            already = self.tree.insert(req.fill_ids[:aligned], slots[:aligned])
            duplicates = slots[req.prefix_len : already]
            if len(duplicates) and self.routed_rows is not None:
                # Our copies of positions the tree already held: where the tree's lack rows
                # and ours have them, the tree keeps ours and we free its old ones instead.
                duplicates = self.tree.offer_duplicates(
                    req.fill_ids[:already], slots[:already], req.prefix_len,
                    prefer=self._has_rows_where_old_lacks,
                )
            self.allocator.free(duplicates)
            self.allocator.free(slots[aligned:])
        else:
            self.allocator.free(slots[req.prefix_len :])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        req.last_node = None
        req.kv_len = req.prefix_len = 0

    def _has_rows_where_old_lacks(self, old: np.ndarray, new: np.ndarray) -> bool:
        rows = self.routed_rows
        assert rows is not None
        return not rows.all_valid(old) and rows.all_valid(new)

    # -- accounting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {
            "total_kv_slots": self.allocator.size,
            "available_kv_slots": self.allocator.available_size(),
            "evictable_kv_slots": self.tree.evictable_size(),
            "locked_kv_slots": self.tree.protected_size(),
            "total_req_slots": self.req_to_token_pool.size,
            "free_req_slots": self.req_to_token_pool.available_size(),
        }

    def flush(self) -> None:
        """Drops the whole prefix cache (only valid while no request holds memory)."""
        self.tree.evict(self.tree.total_size())
        self.tree.reset()


class RankedMemory:
    """The memory of every data-parallel attention rank: rank r's ``ReqMemory`` has its own KV
    allocator (pages of rank r's shard of the KV cache only) and its own radix tree over it;
    all ranks share the request slots (``req_to_token``, indexed by a global request slot)
    and the routed-experts host table (keyed by global KV slot). A request uses the memory of
    its rank (``req.dp_rank``) for its whole life, so all its KV slots are its rank's.

    Without DP attention it holds one rank, and every call is that rank's ``ReqMemory``'s.
    """

    def __init__(self, ranks: Sequence[ReqMemory]) -> None:
        if not ranks:
            raise ValueError("no rank memory")
        pools = {id(m.req_to_token_pool) for m in ranks}
        if len(pools) != 1:
            raise ValueError("the ranks must share one request-slot pool")
        self.ranks = tuple(ranks)
        self.req_to_token_pool = ranks[0].req_to_token_pool
        self.routed_rows = ranks[0].routed_rows
        self.states = ranks[0].states

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> ReqMemory:
        return self.ranks[rank]

    def of(self, req: Req) -> ReqMemory:
        return self.ranks[req.dp_rank]

    def total_kv(self) -> int:
        """Slots of one rank's KV cache (what one request could hold at most)."""
        return self.ranks[0].total_kv()

    def routed_rows_of(
        self, req: Req, start: int | None = None, weights: bool = False, raw: bool = False
    ) -> np.ndarray:
        return self.of(req).routed_rows_of(req, start, weights=weights, raw=raw)

    def release(self, req: Req, cache: bool = True) -> None:
        self.of(req).release(req, cache=cache)

    def stats(self) -> dict[str, int]:
        """``ReqMemory.stats`` summed over the ranks (the shared request slots once)."""
        per_rank = [m.stats() for m in self.ranks]
        out = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
        out["total_req_slots"] = per_rank[0]["total_req_slots"]
        out["free_req_slots"] = per_rank[0]["free_req_slots"]
        return out

    def rank_stats(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s KV slots (without the shared request slots)."""
        s = self.ranks[rank].stats()
        return {k: v for k, v in s.items() if k.endswith("_kv_slots")}

    def flush(self) -> None:
        for m in self.ranks:
            m.flush()
