"""Admission and retraction: which requests a step computes, and where their KV goes.

Owns the request queues of the scheduler: ``waiting`` (FIFO; a retracted request resumes from
the front), ``running`` (prompt complete, decoding) and ``chunked`` (per DP attention rank, the
request whose prompt is part-way prefilled: a prompt is cut where its rank's token budget
ends, so there is at most one per rank).

Prefill (``prefill``) admits waiting requests FIFO within each rank's token budget
(``chunked_prefill_size``), reusing the longest cached prefix, while the KV left covers the
future tokens of the running requests (clipped at ``RESERVE_CLIP`` each, scaled by
``schedule_conservativeness``). Decode (``decode_reqs``) takes every running request that may
grow; when a rank cannot give each a slot, the newest request holding that rank's KV is
retracted (its memory freed, its progress kept) and later resumed by a prefill of everything
it has. A request that does not fit even alone is ended (``RequestEnder``).

Data-parallel attention: everything holds per rank (its own KV allocator and radix tree,
budget, reservation, part-way prompt and retractions); one step holds every rank's rows.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

import numpy as np

from sgl_jax.srt.forward_batch_info import ForwardMode
from sgl_jax.srt.managers.dp_balancer import RankCounts, dp_ranks_of
from sgl_jax.srt.managers.req_memory import RankedMemory
from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch

logger = logging.getLogger(__name__)

# Future tokens of running requests are reserved up to this many each when admitting new
# requests; beyond it, retraction handles the rare request that really grows that long.
RESERVE_CLIP = 256


class RequestEnder(Protocol):
    """The scheduler, as the policy needs it: the step in flight and ending a request."""

    def has_step_in_flight(self) -> bool: ...
    def drain(self) -> None: ...  # processes the step in flight, if any
    def end_out_of_memory(self, req: Req) -> None: ...  # ends a request that cannot fit


class BatchPolicy:
    def __init__(self, memory: RankedMemory, ender: RequestEnder, *, chunk_budget: int,
                 max_running: int, context_len: int, conservativeness: float,
                 draft_scratch: int) -> None:
        self.memory = memory
        self.ender = ender
        self.dp_size = len(memory)
        self.chunk_budget = chunk_budget  # tokens per rank per step
        self.max_running = max_running  # request slots of all ranks
        self.rank_max_running = -(-max_running // self.dp_size)
        self.context_len = context_len
        self.conservativeness = conservativeness
        # Slots a request holds past its step's tokens during the step (EAGLE's chain).
        self.draft_scratch = draft_scratch
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: dict[int, Req] = {}  # rank -> its part-way prefilled request
        self.num_retractions = 0

    # -- queues ---------------------------------------------------------------------------------
    def started(self) -> list[Req]:
        """Requests holding KV: running ones and part-way prefilled prompts."""
        return [*self.running, *self.chunked.values()]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def num_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.chunked)

    def computed_on_current_weights(self) -> list[Req]:
        """Requests computed in part on the current weights (running, chunked, retracted)."""
        return [r for r in [*self.running, *self.chunked.values(), *self.waiting] if r.admitted]

    def find(self, rid: str) -> Req | None:
        return next((r for r in [*self.waiting, *self.started()] if r.rid == rid), None)

    def rank_counts(self) -> RankCounts:
        return RankCounts.of(self.dp_size, self.started(), self.waiting)

    def remove(self, req: Req) -> None:
        """Takes an ended request (not waiting) out of the queues and releases its memory, its routed
        experts gathered first (they are read through its KV slots). A request that holds
        no memory has none to gather: a retracted one keeps the rows taken at retraction,
        one that never started has none (an empty array)."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked.get(req.dp_rank) is req:
            del self.chunked[req.dp_rank]
        holds = req.req_pool_idx is not None
        if req.options.return_routed_experts and (holds or req.routed_experts is None):
            self._gather_routed(req)
        self.memory.release(req, cache=True)

    def _gather_routed(self, req: Req) -> None:
        """``req``'s rows [start_len, n) (and their routing weights, if asked), from the host."""
        # In the table's narrow dtype: converted once, to the wire dtype, when sent.
        req.routed_experts = self.memory.routed_rows_of(req, raw=True)
        if req.options.return_routed_expert_weights:
            req.routed_expert_weights = self.memory.routed_rows_of(req, weights=True)

    # -- prefill --------------------------------------------------------------------------------
    def _future_kv(self, req: Req, kv_len: int) -> int:
        """KV (whole pages, in tokens) for ``req``'s future tokens once it holds ``kv_len``."""
        future = min(req.remaining_new_tokens(), RESERVE_CLIP)
        return self.memory.of(req).kv_needed(kv_len, future)

    def prefill(self, admit_new: bool = True) -> ScheduleBatch | None:
        """An extend step: admits waiting requests FIFO within each rank (a rank that cannot
        take its next one takes no later one this step; other ranks go on). Without
        ``admit_new`` (a weight update waits) only requests computed in part already go on."""
        if not self.waiting and not self.chunked:
            return None
        dp = self.dp_size
        budget = [self.chunk_budget] * dp  # tokens per rank
        on_rank = [0] * dp  # running requests + those of this batch, per rank
        # Reserved for the future tokens of the running requests and of those whose whole
        # prompt this batch computes, per rank.
        future = [0] * dp
        for r in self.running:
            on_rank[r.dp_rank] += 1
            future[r.dp_rank] += self._future_kv(r, r.kv_len)
        blocked: set[int] = set()
        reqs: list[Req] = []
        lens: list[int] = []
        locs: list[np.ndarray] = []
        scratch = self.draft_scratch
        scratches: list[np.ndarray] = []
        candidates = [self.chunked[r] for r in sorted(self.chunked)] + list(self.waiting)
        if not admit_new:
            candidates = [r for r in candidates if r.admitted]
        for req in candidates:
            rank = req.dp_rank
            if len(blocked) == dp or len(self.running) + len(reqs) >= self.max_running:
                break
            if rank in blocked:
                continue
            if budget[rank] == 0 or on_rank[rank] >= self.rank_max_running:
                blocked.add(rank)
                continue
            memory = self.memory[rank]
            alone = on_rank[rank] == 0  # nothing else of its rank holds or reserves KV
            fresh = req.req_pool_idx is None
            if fresh and not memory.admit(req):
                break  # no request slot left (shared by all ranks)
            todo = req.seq_len - req.kv_len
            n = min(todo, budget[rank])
            mine = self._future_kv(req, req.seq_len) if n == todo else 0
            reserve = int((future[rank] + mine) * self.conservativeness)
            slots = None
            need = memory.kv_needed(req.kv_len, n + scratch)
            if memory.available_kv() - reserve >= need or alone:
                slots = memory.alloc_kv(req, n + scratch)
            if slots is None:
                if fresh:
                    memory.release(req, cache=False)
                if alone:
                    # Alone, with every evictable slot evicted, it still does not fit.
                    self.end_unfittable(req)
                    continue
                blocked.add(rank)
                continue
            memory.assign_kv(req, slots)
            if fresh:
                self.waiting.remove(req)
            future[rank] += mine
            on_rank[rank] += 1
            reqs.append(req)
            lens.append(n)
            locs.append(slots[:n])
            scratches.append(slots[n:])
            budget[rank] -= n
        if not reqs:
            return None
        samples = [r.kv_len + n == r.seq_len for r, n in zip(reqs, lens, strict=True)]
        for req, done in zip(reqs, samples, strict=True):
            # A rank's part-way prompt comes first among its candidates: if it is not in this
            # batch, no other request of its rank is, and it stays.
            if not done:
                self.chunked[req.dp_rank] = req
            elif self.chunked.get(req.dp_rank) is req:
                del self.chunked[req.dp_rank]
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens, np.concatenate(locs), samples,
                             dp_ranks=dp_ranks_of(reqs, dp),
                             draft_scratch=np.stack(scratches) if scratch else None)

    # -- decode ---------------------------------------------------------------------------------
    def _growing(self) -> list[Req]:
        """The running requests that decode next, grouped by rank (in running order within).

        A request whose in-flight tokens already reach its limit waits for them instead.
        """
        reqs = [r for r in self.running if r.can_grow(self.context_len)]
        return sorted(reqs, key=lambda r: r.dp_rank) if self.dp_size > 1 else reqs

    def _short_rank(self, reqs: list[Req]) -> int | None:
        """The first rank whose requests of ``reqs`` cannot all get a decode slot, if any."""
        for rank in sorted({r.dp_rank for r in reqs}):
            if not self.memory[rank].decode_fits([r for r in reqs if r.dp_rank == rank]):
                return rank
        return None

    def decode_reqs(self) -> list[Req]:
        """The requests of the next decode step, each with a decode slot's worth of KV
        available: it retracts (or ends, when alone) requests of a rank that is short. Every
        rank must fit before any allocates (a decode slot is recorded when taken)."""
        reqs = self._growing()
        if not reqs:
            return []
        short = self._short_rank(reqs)
        if short is not None and self.ender.has_step_in_flight():
            self.ender.drain()  # finishes may free memory; retraction needs settled requests
            return self.decode_reqs()
        while short is not None:
            self.make_room(short)
            reqs = self._growing()
            if not reqs:
                return []
            short = self._short_rank(reqs)
        return reqs

    def decode_batch(self, reqs: list[Req]) -> ScheduleBatch:
        """A decode step of ``reqs`` (from ``decode_reqs``): one new KV slot each."""
        slots = []
        for rank in sorted({r.dp_rank for r in reqs}):
            got = self.memory[rank].alloc_decode_kv([r for r in reqs if r.dp_rank == rank])
            assert got is not None, "decode_fits promised these slots"
            slots.append(got)
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), np.concatenate(slots),
                             [True] * len(reqs), dp_ranks=dp_ranks_of(reqs, self.dp_size))

    # -- retraction -----------------------------------------------------------------------------
    def _holders(self, rank: int) -> list[Req]:
        """The requests holding KV of ``rank``: its running ones and its part-way prompt."""
        chunked = self.chunked.get(rank)
        return [r for r in self.running if r.dp_rank == rank] + ([chunked] if chunked else [])

    def make_room(self, rank: int = 0) -> None:
        """Frees KV of ``rank``: retracts its newest holder, or ends the only one."""
        holders = self._holders(rank)
        if len(holders) == 1:
            self.end_unfittable(holders[0])
        else:
            self.retract_one(rank)

    def end_unfittable(self, req: Req) -> None:
        """A request that cannot grow even with its rank's whole KV cache to itself ends."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.ender.end_out_of_memory(req)

    def retract_one(self, rank: int = 0) -> None:
        """Frees the memory of the newest request holding KV of ``rank`` (a running one, or
        its part-way prefilled prompt) and queues it to resume from the front (on the same
        rank). Every step that computed part of it has been processed."""
        req = max(self._holders(rank), key=lambda r: r.arrival_time)
        if self.chunked.get(rank) is req:
            del self.chunked[rank]
        else:
            self.running.remove(req)
        if req.options.return_routed_experts:
            # Kept in case it is aborted before it resumes; replaced when it ends.
            self._gather_routed(req)
        self.memory.release(req, cache=True)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.info("KV cache full: retracted %s (%d tokens so far)", req.rid, req.seq_len)
