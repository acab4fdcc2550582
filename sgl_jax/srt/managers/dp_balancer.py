"""Which data-parallel attention rank a new request goes to (``--load-balance-method``).

With ``--enable-dp-attention --dp-size D`` the one scheduler gives every new request to one of
D attention ranks when it arrives; the request keeps that rank for its life (its KV pages are
the rank's, retraction resumes it there). Prefix affinity comes first: a rank whose radix cache
holds the longest prefix of the prompt gets it (a tie is broken by the method among the tied
ranks); with no cached prefix anywhere, the method decides:

- ``round_robin``: ranks in turn.
- ``shortest_queue``: fewest requests (waiting + running) on the rank.
- ``minimum_tokens``: fewest tokens held in the rank's KV cache by its requests plus tokens of
  its waiting requests still to be prefilled.

Ties of the two load-based methods go to the lowest rank. Pure host logic: no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_jax.srt.managers.req_memory import RankedMemory
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.server_args import LOAD_BALANCE_METHODS


@dataclass(frozen=True)
class RankLoad:
    """What the load-based methods compare, for one rank."""

    num_reqs: int  # waiting + running (a part-way prefilled prompt counts as running)
    num_tokens: int  # KV slots its requests hold + tokens of its waiting requests to prefill


@dataclass(frozen=True)
class RankCounts:
    """Requests per rank: started (running or part-way prefilled) and waiting, and the tokens
    the waiting ones still have to prefill."""

    running: list[int]
    waiting: list[int]
    waiting_tokens: list[int]

    @classmethod
    def of(cls, dp_size: int, started: Iterable[Req], waiting: Iterable[Req]) -> RankCounts:
        out = cls([0] * dp_size, [0] * dp_size, [0] * dp_size)
        for req in started:
            out.running[req.dp_rank] += 1
        for req in waiting:
            out.waiting[req.dp_rank] += 1
            out.waiting_tokens[req.dp_rank] += req.seq_len - req.kv_len
        return out

    def loads(self, held_kv: Sequence[int]) -> list[RankLoad]:
        """``held_kv[r]``: KV slots rank r's requests hold now."""
        return [RankLoad(self.running[r] + self.waiting[r], held_kv[r] + self.waiting_tokens[r])
                for r in range(len(self.running))]


def dp_ranks_of(reqs: Sequence[Req], dp_size: int) -> np.ndarray | None:
    """The rank of each request of a step (int32 [B]); None without DP attention."""
    if dp_size == 1:
        return None
    return np.fromiter((r.dp_rank for r in reqs), dtype=np.int32, count=len(reqs))


def rank_info(counts: RankCounts, memory: RankedMemory) -> list[dict[str, int]]:
    """Per DP attention rank: its requests and its KV slots (``/get_server_info``)."""
    return [{"dp_rank": r, "num_running_reqs": counts.running[r],
             "num_waiting_reqs": counts.waiting[r], **memory.rank_stats(r)}
            for r in range(len(memory))]


class DPBalancer:
    def __init__(self, method: str, dp_size: int) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method {method!r}; use one of {LOAD_BALANCE_METHODS}")
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size} must be >= 1")
        self.method = method
        self.dp_size = dp_size
        self._next = 0  # round robin: the rank whose turn it is

    @property
    def needs_loads(self) -> bool:
        """Whether ``choose`` reads the loads (round robin does not: skip computing them)."""
        return self.method != "round_robin"

    def assign(self, req: Req, memory: RankedMemory, counts: Callable[[], RankCounts]) -> int:
        """The rank of new request ``req``: where its prompt's prefix is cached, else by the
        method (``counts()``: the requests of each rank now, read only if the method needs
        loads)."""
        usable = req.origin_input_ids[:-1]  # admission computes the last token at least
        cached = [m.tree.cached_prefix_len(usable) for m in memory.ranks]
        loads = None
        if self.needs_loads:
            loads = counts().loads([m.held_kv() for m in memory.ranks])
        return self.choose(cached, loads)

    def choose(self, cached: Sequence[int], loads: Sequence[RankLoad] | None = None) -> int:
        """The rank for a new request; ``cached[r]``: tokens of its prompt cached on rank r."""
        if len(cached) != self.dp_size:
            raise ValueError(f"{len(cached)} cached lengths for {self.dp_size} ranks")
        best = max(cached)
        ranks = [r for r in range(self.dp_size) if cached[r] == best]
        if len(ranks) == 1:
            return ranks[0]
        if self.method == "round_robin":
            return self._round_robin(ranks)
        if loads is None or len(loads) != self.dp_size:
            raise ValueError(f"{self.method} needs the load of each of {self.dp_size} ranks")
        if self.method == "shortest_queue":
            return min(ranks, key=lambda r: (loads[r].num_reqs, r))
        return min(ranks, key=lambda r: (loads[r].num_tokens, r))

    def _round_robin(self, ranks: list[int]) -> int:
        """The first of ``ranks`` from the rank whose turn it is on; the turn moves past it."""
        for i in range(self.dp_size):
            rank = (self._next + i) % self.dp_size
            if rank in ranks:
                self._next = (rank + 1) % self.dp_size
                return rank
        raise AssertionError("no candidate rank")  # ranks is never empty
