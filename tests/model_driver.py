"""A small test harness that drives the real ModelRunner one request batch at a time.

It plays the scheduler's host-side role (request slots, KV slots, req_to_token) so the tests
of the forward can build exact batches: scattered KV slots, cached prefixes, mixed lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.sampling.sampling_params import SamplingParams


@dataclass
class Seq:
    pool_idx: int
    length: int = 0  # tokens already in the KV cache
    slots: list[int] = field(default_factory=list)
    shared: int = 0  # leading slots borrowed from another Seq (a cached prefix): not freed
    rank: int = 0  # DP attention: the rank whose KV pages it holds


class ModelDriver:
    """With ``page_size > 1`` the driver hands out KV pages itself (in random order, never
    through the allocator): positions [i*P, (i+1)*P) of a sequence share one page. With DP
    attention each sequence lives on one rank and takes that rank's pages only."""

    def __init__(self, runner: ModelRunner, rng_seed: int = 0) -> None:
        self.runner = runner
        self.rng = np.random.default_rng(rng_seed)
        self.page_size = runner.page_size
        self.dp_size = runner.dp_size
        self.free_pages = [
            self.rng.permutation(np.arange(a.first_page + 1, a.first_page + 1 + a.num_pages))
            .tolist() for a in runner.kv_allocators
        ]

    def new_seq(self, rank: int = 0) -> Seq:
        """A new sequence on DP rank ``rank`` (-1: the last rank; all one rank without DP)."""
        idx = self.runner.req_to_token_pool.alloc()
        assert idx is not None
        return Seq(idx, rank=rank % self.dp_size)

    def share_prefix(self, seq: Seq, source: Seq, n: int) -> None:
        """``seq`` starts on ``source``'s first ``n`` tokens (a prefix-cache hit)."""
        assert n % self.page_size == 0, "a cached prefix is whole pages"
        assert seq.rank == source.rank, "a cached prefix is on its own rank's pages"
        self.runner.req_to_token_pool.write(seq.pool_idx, 0, np.asarray(source.slots[:n], np.int32))
        seq.slots = list(source.slots[:n])
        seq.length = seq.shared = n

    def _alloc_pages(self, seq: Seq, n: int) -> np.ndarray:
        size = self.page_size
        out = []
        for pos in range(seq.length, seq.length + n):
            if pos % size == 0:
                page = self.free_pages[seq.rank].pop()
            else:
                page = (out[-1] if out else seq.slots[-1]) // size
            out.append(page * size + pos % size)
        return np.asarray(out, np.int32)

    def _alloc(self, seq: Seq, n: int, scatter: bool) -> np.ndarray:
        # Allocate more than needed and keep a random subset, so a request's slots are not
        # contiguous; the spare slots go back to the pool.
        pool = self.runner.kv_allocators[seq.rank]
        extra = min(n, pool.available_size() - n) if scatter else 0
        got = pool.alloc(n + extra)
        assert got is not None
        pick = self.rng.permutation(len(got))
        chosen, spare = got[pick[:n]], got[pick[n:]]
        pool.free(spare)
        return chosen

    def step(
        self, mode: ForwardMode, seqs: list[Seq], new_tokens: list[list[int]], scatter: bool = True
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Runs one batch; returns (logits [B, V], routed rows of each seq's new tokens)."""
        pool = self.runner.req_to_token_pool
        locs = []
        for seq, toks in zip(seqs, new_tokens, strict=True):
            if self.page_size > 1:
                loc = self._alloc_pages(seq, len(toks))
            else:
                loc = self._alloc(seq, len(toks), scatter)
            pool.write(seq.pool_idx, seq.length, loc)
            locs.append(loc)
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            req_pool_indices=np.array([s.pool_idx for s in seqs], np.int32),
            prefix_lens=np.array([s.length for s in seqs], np.int32),
            extend_lens=np.array([len(t) for t in new_tokens], np.int32),
            input_ids=np.concatenate([np.asarray(t, np.int32) for t in new_tokens]),
            out_cache_loc=np.concatenate(locs).astype(np.int32),
            sampling_params=[SamplingParams(temperature=0.0).normalize() for _ in seqs],
            seeds=[0] * len(seqs),
            steps=[0] * len(seqs),
            return_routed_experts=True,
            dp_ranks=(np.array([s.rank for s in seqs], np.int32) if self.dp_size > 1
                      else None),
        )
        batch, out = self.runner.run_worker_batch(mwb)
        self.runner.capturer.on_forward_end(
            out.routed_rows, mwb.out_cache_loc, mwb.num_tokens, copy=True
        )
        host = self.runner.capturer.host_cache
        rows = [host.gather(loc) for loc in locs]
        for seq, loc in zip(seqs, locs, strict=True):
            seq.slots.extend(loc.tolist())
            seq.length += len(loc)
        logits = np.asarray(out.logits)[: len(seqs)]
        self.last_next_ids = np.asarray(out.next_token_ids)[: len(seqs)]
        self.last_batch = batch
        return logits, rows

    def release(self, seq: Seq) -> None:
        own = np.asarray(seq.slots[seq.shared :], np.int32)
        if self.page_size > 1:
            self.free_pages[seq.rank].extend(sorted({int(s) // self.page_size for s in own}))
        else:
            self.runner.kv_allocators[seq.rank].free(own)
        self.runner.req_to_token_pool.free(seq.pool_idx)
