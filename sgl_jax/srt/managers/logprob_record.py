"""A request's logprobs on the host: recorded step by step, sent out in increments.

Entries follow SGLang's ``meta_info`` format without the text (the tokenizer manager adds it):
``(logprob, token_id)`` per position for ``*_token_logprobs``, and per position a list of such
pairs for ``*_top_logprobs`` (most likely first) and ``*_token_ids_logprobs`` (the asked ids, in
the asked order). Input position 0 has no logprob: ``(None, first_prompt_token)``. A message
carries a request's new entries (``LogprobsOut``) to the tokenizer manager, which adds the
text (``logprobs_meta_info``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("token_logprobs", "top_logprobs", "token_ids_logprobs")
# Every meta_info key of logprobs ends with one of these ("input_top_logprobs", ...).
KEY_SUFFIXES = tuple(f"_{kind}" for kind in KINDS)


def is_logprob_key(key: str) -> bool:
    return key.endswith(KEY_SUFFIXES)


# A message's logprob payload: a request's entries since its previous message, by meta_info
# key (the kinds it asked for), without their token text. A plain dict: it pickles inline
# (a wrapper object would cost a pickling hook per request on every streamed step).
LogprobsOut = dict[str, list[Any]]


def logprobs_meta_info(entries: LogprobsOut,
                       token_text: Callable[[int], str] | None) -> dict[str, list[Any]]:
    """The logprob keys of a ``meta_info``: each ``(logprob, token_id)`` of ``entries`` gains
    its token's text (``token_text``, for ``return_text_in_logprobs``) or None."""

    def entry(pair: tuple) -> tuple:
        return (pair[0], pair[1], None if token_text is None else token_text(pair[1]))

    out = {}
    for key, values in entries.items():
        if key.endswith("_token_logprobs"):
            out[key] = [entry(v) for v in values]
        else:  # per position a list of pairs (None for prompt position 0)
            out[key] = [None if v is None else [entry(p) for p in v] for v in values]
    return out


@dataclass
class LogprobRecord:
    top_n: int  # top logprobs per position
    token_ids: list[int] | None  # ids asked at every position
    input_start: int | None  # first prompt position with an input logprob; None: none
    first_token: int  # the prompt's first token (position 0 has no logprob, only its id)
    entries: dict[str, list[Any]] = field(default_factory=dict)  # "input_top_logprobs" -> ...
    sent: dict[str, int] = field(default_factory=dict)  # how many of each went out
    # The next prompt position whose logprob no launched step computes yet (steps are
    # planned at launch and recorded, in the same order, when processed).
    next_input: int = 0

    def __post_init__(self) -> None:
        for side in ("input", "output"):
            for kind in KINDS:
                self.entries[f"{side}_{kind}"] = []
                self.sent[f"{side}_{kind}"] = 0
        if self.input_start is not None:
            self.next_input = max(self.input_start, 1)
            if self.input_start == 0:
                self._add_first_input()

    @classmethod
    def for_request(cls, options: Any, input_ids: list[int]) -> LogprobRecord | None:
        """The record of a request with validated ``RequestOptions``; None if it asks none."""
        if not options.return_logprob:
            return None
        return cls(top_n=options.top_logprobs_num, token_ids=options.token_ids_logprob,
                   input_start=options.input_logprob_start, first_token=input_ids[0])

    def cacheable_prefix(self, prompt_len: int) -> int | None:
        """How much of the sequence may come from the prefix cache (cached positions have no
        logits), or None for no limit: up to the token before the next prompt position."""
        if self.input_start is None or self.next_input >= prompt_len:
            return None
        return self.next_input - 1

    def plan_input(self, kv_start: int, n: int, prompt_len: int) -> list[int]:
        """The prompt positions p whose logprob an extend of tokens [kv_start, kv_start + n)
        computes (from the logits at p - 1); marks them planned."""
        if self.input_start is None:
            return []
        first = max(self.next_input, kv_start + 1)
        last = min(kv_start + n, prompt_len - 1)  # logits at prompt_len - 1 sample an output
        positions = list(range(first, last + 1))
        if positions:
            self.next_input = positions[-1] + 1
        return positions

    def add(self, side: str, logprob: float | None, token: int, top_values: np.ndarray,
            top_ids: np.ndarray, id_values: np.ndarray) -> None:
        """One position: the logprob of its token, and the rows of the top and asked ids."""
        self.entries[f"{side}_token_logprobs"].append(
            (None if logprob is None else float(logprob), int(token)))
        if self.top_n:
            self.entries[f"{side}_top_logprobs"].append(
                [(float(v), int(i)) for v, i in zip(top_values[: self.top_n],
                                                    top_ids[: self.top_n], strict=True)])
        if self.token_ids is not None:
            self.entries[f"{side}_token_ids_logprobs"].append(
                [(float(v), t) for v, t in zip(id_values, self.token_ids, strict=False)])

    def _add_first_input(self) -> None:
        """Position 0 of the prompt: nothing precedes it, so no logprob (SGLang gives None)."""
        self.entries["input_token_logprobs"].append((None, self.first_token))
        if self.top_n:
            self.entries["input_top_logprobs"].append(None)
        if self.token_ids is not None:
            self.entries["input_token_ids_logprobs"].append(None)

    def take_new(self) -> LogprobsOut:
        """The entries recorded since the previous call (the kinds the request asked for)."""
        out = {}
        for key, values in self.entries.items():
            if not self._asked(key):
                continue
            out[key] = values[self.sent[key]:]
            self.sent[key] = len(values)
        return out

    def _asked(self, key: str) -> bool:
        if key.startswith("input_") and self.input_start is None:
            return False
        if key.endswith("top_logprobs"):
            return self.top_n > 0
        if key.endswith("token_ids_logprobs"):
            return self.token_ids is not None
        return True
