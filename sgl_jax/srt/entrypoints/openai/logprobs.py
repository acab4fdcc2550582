"""OpenAI's logprobs formats, built from the manager's SGLang-style ``meta_info`` entries.

The manager gives ``*_token_logprobs`` as ``(logprob, token_id, text)`` per position and
``*_top_logprobs`` as a list of such per position (``return_text_in_logprobs`` on, so ``text``
is the token's own text). Completions use the legacy format (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``), chat the ``content`` list (``token``, ``logprob``,
``bytes``, ``top_logprobs``). With ``echo`` the prompt's positions come first (the first has no
logprob: ``None``).
"""

from __future__ import annotations

from typing import Any

from sgl_jax.srt.entrypoints.openai.protocol import OpenAIError
from sgl_jax.srt.managers.logprob_record import is_logprob_key
from sgl_jax.srt.sampling.sampling_params import MAX_TOP_LOGPROBS


def without_logprobs(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """``meta_info`` without the SGLang logprob lists (the OpenAI ``logprobs`` field has them)."""
    if meta is None:
        return None
    return {k: v for k, v in meta.items() if not is_logprob_key(k)}


def _check_top(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise OpenAIError(400, f"'{param}' must be in [0, {MAX_TOP_LOGPROBS}], not {value}",
                          param=param)


def completion_options(logprobs: int | None, echo: bool) -> dict[str, Any]:
    """Request options for a completions request's ``logprobs`` (top count) and ``echo``."""
    _check_top(logprobs, "logprobs")
    if logprobs is None:
        return {}
    options = {"return_logprob": True, "top_logprobs_num": logprobs,
               "return_text_in_logprobs": True}
    if echo:
        options["logprob_start_len"] = 0
    return options


def chat_options(logprobs: bool | None, top_logprobs: int | None) -> dict[str, Any]:
    _check_top(top_logprobs, "top_logprobs")
    if top_logprobs and not logprobs:
        raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not logprobs:
        return {}
    return {"return_logprob": True, "top_logprobs_num": top_logprobs or 0,
            "return_text_in_logprobs": True}


def _positions(meta: dict[str, Any], sides: tuple[str, ...]) -> tuple[list, list]:
    tokens: list = []
    tops: list = []
    for side in sides:
        entries = meta.get(f"{side}_token_logprobs") or []
        tokens += entries
        tops += meta.get(f"{side}_top_logprobs") or [None] * len(entries)
    return tokens, tops


class CompletionLogprobs:
    """One choice's legacy logprobs, piece by piece (``text_offset`` runs on across pieces)."""

    def __init__(self, echo: bool) -> None:
        self.sides = ("input", "output") if echo else ("output",)
        self.offset = 0

    def piece(self, meta: dict[str, Any]) -> dict[str, Any]:
        tokens, tops = _positions(meta, self.sides)
        self.sides = ("output",)  # the prompt's positions come once
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for (logprob, _, text), top in zip(tokens, tops, strict=True):
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None else _by_text(top))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _by_text(top: list) -> dict[str, float]:
    """Top entries keyed by token text, as OpenAI's legacy format has them; tokens whose text
    is the same (e.g. partial UTF-8 bytes) keep the most likely one's logprob."""
    out: dict[str, float] = {}
    for logprob, _, text in _possible(top):
        out.setdefault(text, logprob)
    return out


def _possible(top: list | None) -> list:
    """Top entries without the ids a grammar forbade (logprob -inf): OpenAI allows fewer
    than the asked number, and -inf is not a JSON number."""
    return [e for e in top or [] if e[0] is not None and e[0] != float("-inf")]


def _chat_entry(logprob: float, text: str) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """The chat ``logprobs`` of a response or chunk: ``{"content": [...]}`` of its tokens."""
    tokens, tops = _positions(meta, ("output",))
    return {"content": [
        {**_chat_entry(logprob, text),
         "top_logprobs": [_chat_entry(lp, t) for lp, _, t in _possible(top)]}
        for (logprob, _, text), top in zip(tokens, tops, strict=True)
    ]}
