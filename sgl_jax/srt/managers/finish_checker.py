"""Whether a request is done after its latest token: EOS, stop ids or strings, length, context,
or its grammar complete (constrained decoding: the token also moves the request's matcher on)."""

from __future__ import annotations

from collections.abc import Iterable

from sgl_jax.srt.constrained.matchers import GrammarMatchers
from sgl_jax.srt.managers.schedule_batch import (
    Req,
    finish_abort,
    finish_length,
    finish_matched_str,
    finish_matched_token,
)
from sgl_jax.srt.tokenizer import Tokenizer

# Stop strings are looked for in the decoded tail: this many tokens beyond the longest stop
# string's length in characters (a token is at least one character, and a few more cover
# tokens that only decode together).
STOP_TAIL_SLACK = 8


class FinishChecker:
    def __init__(self, eos_ids: Iterable[int], context_len: int, tokenizer: Tokenizer,
                 grammar: GrammarMatchers | None = None) -> None:
        self.eos_ids = frozenset(eos_ids)
        self.context_len = context_len
        self.tokenizer = tokenizer
        self.grammar = grammar

    def check(self, req: Req) -> None:
        """Sets ``req.finished_reason`` if its latest output token ends it."""
        params = req.sampling_params
        token = req.output_ids[-1]
        complete = False
        if req.grammar is not None and self.grammar is not None:
            error, complete = self.grammar.advance(req, token)
            if error is not None:
                req.finished_reason = finish_abort(error)
                return
        if not params.ignore_eos and token in self.eos_ids:
            req.finished_reason = finish_matched_token(token)
        elif params.stop_token_ids and token in params.stop_token_ids:
            req.finished_reason = finish_matched_token(token)
        elif complete:  # the grammar admits nothing more (SGLang: a matched-token stop)
            req.finished_reason = finish_matched_token(token)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finished_reason = finish_length(params.max_new_tokens)
        elif req.seq_len >= self.context_len:
            req.finished_reason = finish_length(len(req.output_ids))
        elif params.stop:
            longest = max(len(s) for s in params.stop)
            tail = self.tokenizer.decode(
                req.output_ids[-(longest + STOP_TAIL_SLACK) :],
                skip_special_tokens=params.skip_special_tokens,
            )
            matched = next((s for s in params.stop if s in tail), None)
            if matched is not None:
                req.finished_reason = finish_matched_str(matched)
