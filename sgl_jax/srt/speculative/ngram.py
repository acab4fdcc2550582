"""NGRAM drafts (prompt lookup): continue the sequence the way it continued before.

The longest suffix of the sequence (between ``min_window`` and ``max_window`` tokens) that
also occurs earlier in it is looked up; the tokens that followed its most recent earlier
occurrence are the draft. No model runs: the proposer costs O(sequence length) numpy work
per request per step, and a draft that is wrong only costs the verify step's extra tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, min_window: int = 1, max_window: int = 12) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram windows {min_window}..{max_window}: need 1 <= min <= max")
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow ``tokens`` ([] when nothing matches)."""
        n = len(tokens)
        if max_tokens <= 0 or n < 2:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        # Ends of earlier occurrences of the suffix, narrowed one window length at a time:
        # ``ends`` holds the indices e (e <= n - 2) with seq[e - w + 1 : e + 1] == seq[-w:].
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        matched = 1 if len(ends) else 0
        for w in range(2, min(self.max_window, n - 1) + 1):
            longer = ends[ends >= w - 1]
            longer = longer[seq[longer - (w - 1)] == seq[n - w]]
            if not len(longer):
                break
            ends, matched = longer, w
        if matched < self.min_window:
            return []
        start = int(ends[-1]) + 1  # the most recent occurrence's continuation
        return seq[start : start + max_tokens].tolist()
