"""The scheduler's side of constrained decoding: one llguidance matcher per constrained
request, kept in the request's auxiliary-state slot (``mem_cache/request_state.py``), the
step's packed vocabulary mask, and the matcher moved on by each accepted token.

Life of a matcher:

- ``prepare`` (the request arrives): the matcher is built in a worker thread (llguidance
  drops the GIL while it builds), so a large grammar does not stall the step loop.
- ``matcher`` (its first masked step): taken from that build into the request's state slot.
- ``advance`` (every sampled token that becomes an output): the matcher consumes it. Only
  accepted tokens ever reach a matcher; speculative decoding with a grammar is refused.
- The slot's release (finish, abort, retraction) drops it (``RequestStateTable.free``). A
  retracted request that resumes gets a new slot and so a new matcher, which replays the
  tokens it had generated (``matcher``): the same state, rebuilt.

Invariant: the mask of a request's step is computed after every token before it has been
consumed; the scheduler processes a step holding a constrained request before it schedules
the next (no overlap for those steps).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from sgl_jax.srt.constrained.grammar import llg_tokenizer, parser_limits
from sgl_jax.srt.mem_cache.request_state import RequestStateTable, StateKind
from sgl_jax.srt.tokenizer import Tokenizer

GRAMMAR_MATCHERS = "grammar_matchers"
ALL_ALLOWED = -1  # an int32 word with every bit set: 32 allowed ids


class _ConstrainedReq(Protocol):
    grammar: str | None
    grammar_build: Any
    state_slot: int | None
    output_ids: list[int]


def mask_words(vocab_size: int) -> int:
    """int32 words of a packed mask over ``vocab_size`` ids (bit ``i % 32`` of word
    ``i // 32`` is id ``i``, llguidance's layout)."""
    return (vocab_size + 31) // 32


class GrammarMatchers:
    def __init__(self, tokenizer: llguidance.LLTokenizer, states: RequestStateTable) -> None:
        self.tokenizer = tokenizer
        self.states = states
        states.register(StateKind(GRAMMAR_MATCHERS, (), np.dtype(object), fill=None))
        self.words = mask_words(tokenizer.vocab_size)
        self._builds = ThreadPoolExecutor(1, "grammar-build")
        self._executor = llguidance.LLExecutor(num_threads=2)

    def _new(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())

    def prepare(self, req: _ConstrainedReq) -> None:
        """Starts building ``req``'s matcher (when it has a grammar)."""
        if req.grammar is not None:
            req.grammar_build = self._builds.submit(self._new, req.grammar)

    def matcher(self, req: _ConstrainedReq) -> llguidance.LLMatcher:
        """``req``'s matcher, in its state slot (built, or rebuilt and replayed, if absent)."""
        rows = self.states.rows(GRAMMAR_MATCHERS)
        m = rows[req.state_slot]
        if m is None:
            build: Future | None = req.grammar_build
            req.grammar_build = None
            m = build.result() if build is not None else self._new(req.grammar)
            if req.output_ids:  # resumed after a retraction: the same state again
                m.consume_tokens(req.output_ids)
            rows[req.state_slot] = m
        return m

    @staticmethod
    def any_constrained(reqs: list[Any]) -> bool:
        return any(r.grammar is not None for r in reqs)

    def mask(self, reqs: list[Any], samples: list[bool]) -> np.ndarray | None:
        """The step's packed mask [len(reqs), words] int32 (all ids allowed in the rows of
        requests without a grammar or that sample nothing), or None when no row is
        constrained."""
        rows = [(self.matcher(r), i) for i, (r, s) in enumerate(zip(reqs, samples, strict=True))
                if s and r.grammar is not None]
        if not rows:
            return None
        out = np.full((len(reqs), self.words), ALL_ALLOWED, np.int32)
        if len(rows) == 1:
            fill_next_token_bitmask(rows[0][0], out, rows[0][1])
        else:  # llguidance's threads (the GIL is released while they run)
            fill_next_token_bitmask_par(self._executor, rows, out)
        return out

    def advance(self, req: _ConstrainedReq, token: int) -> tuple[str | None, bool]:
        """Consumes ``req``'s new token: (the matcher's error when it refuses it, whether the
        grammar is complete and admits nothing more but the end of sequence)."""
        m = self.matcher(req)
        if not m.consume_token(token):
            return f"the grammar refused token {token}: {m.get_error()}", False
        return None, m.is_stopped()

    @classmethod
    def for_server(cls, backend: str, tokenizer: Tokenizer, vocab_size: int,
                   eos_ids: list[int], states: RequestStateTable) -> GrammarMatchers | None:
        """The scheduler's matchers (None with ``--grammar-backend none``)."""
        if backend == "none":
            return None
        return cls(llg_tokenizer(tokenizer, vocab_size, eos_ids), states)

    def close(self) -> None:
        self._builds.shutdown(wait=False, cancel_futures=True)
