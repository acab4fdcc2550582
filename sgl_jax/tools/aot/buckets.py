"""The steps a report compiles (buckets): decode, speculative verify, prefill and extend,
with and without data-parallel attention, at the shapes the engine pads them to."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One compiled step. With data-parallel attention (``dp > 1``) the figures are GLOBAL
    (all ranks): the requests are dealt round robin over the ``dp`` ranks, every rank's
    sub-batch is padded to the same per-rank size, and ``padded_tokens`` / ``rows`` are
    ``dp`` times that size (the shape the step is compiled with)."""

    mode: str  # "decode" | "verify" | "prefill"
    tokens: int  # real tokens of the step, all ranks
    requests: int  # real requests, all ranks
    rows: int  # padded rows the engine compiles this bucket with, all ranks
    q_len: int  # new tokens per request
    prefix: int  # cached positions per request before the step
    dp: int = 1  # attention ranks the requests are spread over
    padded_tokens: int = 0  # tokens compiled, all ranks (0: = tokens, no padding)

    @property
    def compiled_tokens(self) -> int:
        return self.padded_tokens or self.tokens

    @property
    def sampled(self) -> int:
        """Logits rows the step computes and samples: one per request; in a verify step one
        per token (each request's last token and every draft)."""
        return self.tokens if self.mode == "verify" else self.requests

    @property
    def compiled_sampled(self) -> int:
        """Logits rows the step is compiled with (padded)."""
        return self.compiled_tokens if self.mode == "verify" else self.rows

    @property
    def context_len(self) -> int:
        """KV length of each request's last token."""
        return self.prefix + self.q_len

    @property
    def pairs_per_request(self) -> int:
        """(query, key) pairs of one request's new tokens (causal)."""
        n, p = self.q_len, self.prefix
        return n * p + n * (n + 1) // 2

    @property
    def q_kv_pairs(self) -> int:
        """sum over query tokens of the positions each attends to (causal), all ranks."""
        return self.requests * self.pairs_per_request

    @property
    def rank_requests(self) -> int:
        """Requests of the busiest attention rank (all of them without DP)."""
        return -(-self.requests // self.dp)

    @property
    def rank_load(self) -> float:
        """Real attention work of all ranks over ``dp`` times the busiest rank's (1 when the
        requests divide evenly over the ranks; 0.5 when half the ranks are idle)."""
        return self.requests / (self.rank_requests * self.dp)


def dp_buckets(decode_bs: list[int], prefill_tokens: int, prefill_requests: int,
               context_len: int, dp: int, rank_rows: Any,
               verify_tokens: int | None = None) -> list[Bucket]:
    """The report's buckets. ``decode_bs`` and the prefill are GLOBAL: with ``dp`` ranks a
    decode batch of B requests is ``ceil(B / dp)`` rows per rank, and the prefill's requests
    (``prefill_tokens / prefill_requests`` new tokens each, whole requests: a request's KV
    lives on one rank) go round robin to the ranks, each rank padded to the busiest one's
    tokens. ``rank_rows(tokens)``: the rows one rank's extend sub-batch of ``tokens`` is
    compiled with (the engine's ``extend_rows``). dp = 1: exactly the buckets of a report
    without DP. ``verify_tokens`` K (speculative decoding, dp = 1 only): after each decode
    bucket, the TARGET_VERIFY step of the same requests, K tokens each (its last token and
    K - 1 drafts) on top of ``context_len - K`` cached positions, so that its last token is
    at ``context_len`` positions as the decode bucket's is (same KV read per request)."""
    per_req = prefill_tokens // prefill_requests
    buckets = []
    for bs in decode_bs:
        rank = -(-bs // dp)
        buckets.append(Bucket("decode", bs, bs, rank * dp, 1, context_len - 1, dp,
                              0 if rank * dp == bs else rank * dp))
        if verify_tokens:
            buckets.append(Bucket("verify", bs * verify_tokens, bs, bs, verify_tokens,
                                  context_len - verify_tokens))
    rank_tokens = -(-prefill_requests // dp) * per_req
    padded = rank_tokens * dp
    if not prefill_tokens:  # --prefill-tokens 0: no prefill bucket
        return buckets
    buckets.append(Bucket("prefill", prefill_tokens, prefill_requests,
                          rank_rows(rank_tokens) * dp, per_req, 0, dp,
                          0 if padded == prefill_tokens else padded))
    return buckets


def extend_padding(tokens: int, prefill_tokens: int) -> int:
    """The token bucket the engine pads an extend of ``tokens`` to (ServerArgs' default
    paddings: powers of two from 64, or from the chunk when it is smaller)."""
    chunk = max(prefill_tokens, tokens)
    padded = min(64, chunk)
    while padded < tokens:
        padded *= 2
    return min(padded, chunk)


def extend_buckets(extend_tokens: list[int], context_len: int, prefill_tokens: int,
                   rows: Any) -> list[Bucket]:
    """``--extend-tokens``: one request appending N new tokens to a cached context (a
    multi-turn rollout's next turn), its last token at ``context_len`` positions as in
    decode; compiled at the engine's token bucket for N and its rows (``rows(padded)``)."""
    out = []
    for n in extend_tokens:
        padded = extend_padding(n, prefill_tokens)
        out.append(Bucket("extend", n, 1, rows(padded), n, context_len - n, 1,
                          0 if padded == n else padded))
    return out
