"""Memory of requests in the scheduler: request slots, KV slots and the prefix cache.

Every KV slot a request holds is ``req_to_token[req.req_pool_idx, :req.kv_len]``; the first
``req.prefix_len`` of them belong to the radix tree (locked through ``req.last_node``), the
rest to the request. Releasing a request hands its own slots to the tree or back to the pool,
so that after every request is released the pool plus the tree's evictable slots are all the
slots there are.
"""

from __future__ import annotations

import numpy as np

from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.radix_cache import RadixCache


class ReqMemory:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: TokenToKVPoolAllocator,
        tree: RadixCache,
        capturer: RoutedExpertsCapturer,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree = tree
        self.capturer = capturer

    # -- admission ------------------------------------------------------------------------------
    def available_kv(self) -> int:
        """Slots obtainable now: free ones plus those the tree could evict."""
        return self.allocator.available_size() + self.tree.evictable_size()

    def admit(self, req: Req) -> bool:
        """Gives ``req`` a request slot and its longest usable cached prefix (locked)."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        # At least one token must be computed: its logits sample the next token.
        usable = req.fill_ids[: req.seq_len - 1]
        slots, node = self.tree.match_prefix(usable)
        if req.return_routed_experts:
            # Reuse only KV whose routed-experts rows were captured when it was computed.
            valid = self.capturer.valid_prefix_len(slots)
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

    def alloc_kv(self, n: int) -> np.ndarray | None:
        slots = self.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        return slots

    def assign_kv(self, req: Req, slots: np.ndarray) -> None:
        """Records the slots of ``req``'s next ``len(slots)`` positions (not yet computed)."""
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots)

    # -- release --------------------------------------------------------------------------------
    def release(self, req: Req, cache: bool = True) -> None:
        """Frees everything ``req`` holds; with ``cache``, its computed KV joins the tree."""
        if req.req_pool_idx is None:
            return
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].copy()
        if cache and not self.tree.disable:
            already = self.tree.insert(req.fill_ids[: req.kv_len], slots)
            self.allocator.free(slots[req.prefix_len : already])
        else:
            self.allocator.free(slots[req.prefix_len :])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.prefix_len = 0

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
