"""A step's host inputs, before dispatch: the padded shape of a batch (its bucket), the padded
batch itself, and the page rows the device page table needs first.

One jitted step is compiled per (mode, padded tokens, padded rows): decode (and verify) steps
are padded to a batch-size bucket (``--precompile-bs-paddings``), extend steps to a token bucket
(``--precompile-token-paddings``); a shape past the largest bucket is rounded up to a multiple
of 64 and compiled on demand. With DP attention the buckets are per rank, and every rank is
padded to the bucket of the busiest one.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import jax
import numpy as np

from sgl_jax.srt.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    ModelWorkerBatch,
    build_dp_forward_batch,
    build_forward_batch,
    dp_rank_sizes,
)
from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(buckets: list[int], n: int) -> int:
    """The smallest bucket >= n; past the largest, a multiple of 64 (compiled on demand)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else round_up(n, 64)


@dataclass(frozen=True)
class StepShapes:
    """The padded shapes a runner's steps take (per DP attention rank)."""

    bs_paddings: list[int]
    token_paddings: list[int]
    max_running_requests: int
    dp_size: int
    # Tokens a request brings to a verify step at most (its last token and its drafts); 0
    # without speculation (no verify shapes).
    verify_tokens: int

    def padded_decode_bs(self, bs: int) -> int:
        return bucket(self.bs_paddings, bs)

    def padded_extend_tokens(self, num_tokens: int) -> int:
        return bucket(self.token_paddings, num_tokens)

    def extend_rows(self, padded_tokens: int) -> int:
        """Rows of an extend batch of ``padded_tokens``: one per request, each >= 1 token
        (with DP attention, of one rank: its share of the running requests)."""
        return min(padded_tokens, -(-self.max_running_requests // self.dp_size))

    def padded(self, mode: ForwardMode, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """(tokens, rows) of the bucket of a batch of ``num_tokens`` tokens in ``num_rows``."""
        if mode.is_decode:
            rows = self.padded_decode_bs(num_rows)
            return rows, rows
        if mode.is_verify:  # up to verify_tokens per request
            rows = self.padded_decode_bs(num_rows)
            return rows * self.verify_tokens, rows
        tokens = self.padded_extend_tokens(num_tokens)
        return tokens, self.extend_rows(tokens)

    def all(self) -> list[tuple[ForwardMode, int, int]]:
        """Every bucket as (mode, tokens, rows): what start-up precompiles. With speculation
        every decode step is a verify step."""
        shapes = [(ForwardMode.TARGET_VERIFY, bs * self.verify_tokens, bs) if self.verify_tokens
                  else (ForwardMode.DECODE, bs, bs) for bs in self.bs_paddings]
        return shapes + [(ForwardMode.EXTEND, t, self.extend_rows(t))
                         for t in self.token_paddings]


@dataclass
class StepPlan:
    """One step's host inputs: what every node of a multi-node job dispatches identically."""

    mwb: ModelWorkerBatch
    batch: ForwardBatch  # ``mwb`` padded to its bucket
    prefix_pages: list[tuple[int, np.ndarray]]  # (request slot, page row) to send first

    def digest(self) -> str:
        """A hash of everything the devices receive, to check that nodes dispatch alike."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(self.batch.forward_mode).encode())
        for x in jax.tree.leaves(self.batch) + [a for row in self.prefix_pages for a in row]:
            x = np.asarray(x)
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        return h.hexdigest()


def prefix_page_rows(pool: ReqToTokenPool, mwb: ModelWorkerBatch,
                     page_size: int) -> list[tuple[int, np.ndarray]]:
    """The page row of each request that starts on a cached prefix the device page table does
    not hold yet (once per admission; the step records every other page), read from the host
    pool, which learns what the device will hold."""
    rows = []
    for idx, prefix, extend in zip(
        mwb.req_pool_indices, mwb.prefix_lens, mwb.extend_lens, strict=True
    ):
        if pool.device_len[idx] < prefix:
            # A fresh array: on CPU the device may read it in place after we return.
            pages = pool.req_to_token[idx, ::page_size] // page_size
            rows.append((int(idx), pages.astype(np.int32)))
        pool.device_len[idx] = prefix + extend
    return rows


def pad_batch(mwb: ModelWorkerBatch, shapes: StepShapes, vocab_size: int, no_req_slot: int,
              padding_slots: list[int], draft_steps: int) -> ForwardBatch:
    """``mwb`` padded to its bucket (DP attention: every rank to the busiest one's)."""
    dp = shapes.dp_size > 1
    if draft_steps and not mwb.forward_mode.is_decode and mwb.draft_scratch is None:
        raise ValueError("EAGLE / NEXTN: extend and verify batches need draft_scratch (the chain's "
                         f"{draft_steps - 1} slots per row) and draft_next_ids")
    if dp and mwb.dp_ranks is None:
        raise ValueError("DP attention: the batch must give each row's rank (dp_ranks)")
    num_tokens, num_rows = (dp_rank_sizes(mwb, shapes.dp_size) if dp
                            else (mwb.num_tokens, mwb.batch_size))
    tokens, rows = shapes.padded(mwb.forward_mode, num_tokens, num_rows)
    if dp:
        return build_dp_forward_batch(mwb, tokens, rows, vocab_size, no_req_slot, padding_slots)
    return build_forward_batch(mwb, tokens, rows, vocab_size, no_req_slot)
