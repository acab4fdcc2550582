"""Streaming detokenization of one request: output ids in, final text pieces out.

Two stages, each holding back text that a later token could still change:

1. Bytes -> text. Byte-level BPE may split one UTF-8 character over several tokens; decoding a
   partial character yields U+FFFD. Ids are decoded in a small window
   ``ids[prefix_offset:]`` and the text of ``ids[prefix_offset:read_offset]`` (already emitted)
   is cut off the front, so a push costs O(window), not O(output). The window's leading
   context tokens let decoders whose output depends on the previous token (leading-space
   handling) decode the new tokens as they would in the full sequence.
2. Stop strings. Text whose end could begin a stop string is held until resolved; on a match
   the text is trimmed at the match start and nothing more is ever emitted.

Invariant (byte-level decoders, no stop match): the concatenation of every piece returned by
``push``/``finish`` equals ``tokenizer.decode(all_output_ids, skip_special_tokens)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from sgl_jax.srt.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Tokens of context decoded before the first unemitted token (at least, when available).
CONTEXT_TOKENS = 4
# When held text ends in U+FFFD, this many latest token positions are tried as a split point
# between final text and a still-incomplete character (one character is at most 4 bytes).
SPLIT_SEARCH_TOKENS = 8
# A held tail longer than this is emitted as is. Unreachable for byte-level BPE unless dozens
# of skipped special tokens sit inside one character; it bounds the cost per push.
MAX_HELD_TOKENS = 64
# Ids before the decode window are dropped once this many accumulate (bounded memory).
_COMPACT_AT = 512


class IncrementalDecoder:
    """Per-request incremental detokenizer with stop-string trimming.

    ``push(ids)`` returns the text that became final with those ids (maybe ""); ``finish()``
    flushes whatever is still held when the request ends. ``text`` is everything emitted so far;
    ``stopped_by`` is the stop string that matched, if any (``text`` then ends just before it).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids_tail: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; they are ignored (None means no stops).
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in (stop or ()) if s))
        self.text: str = ""
        self.stopped_by: str | None = None
        self._finished = False
        self._held_stop_text = ""  # emitted by stage 1, held by stage 2 (could start a stop)

        self._ids: list[int] = self._usable_context(prompt_ids_tail)
        # Token offsets at which the decoded text ends on a character boundary, ascending;
        # the decode window always starts at the first one.
        self._boundaries: deque[int] = deque(dict.fromkeys((0, len(self._ids))))
        self._read_offset = len(self._ids)  # ids before it are emitted (or context)
        self._prefix_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self._move_window()

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _usable_context(self, prompt_ids_tail: Sequence[int]) -> list[int]:
        """The prompt tail without a cut character at either end.

        A tail ending inside a character would glue the prompt's bytes to the first output
        bytes (the output must decode as it does alone); one starting inside a character could
        make the window's first bytes decode differently later.
        """
        context = list(prompt_ids_tail)[-CONTEXT_TOKENS:]
        if not context or self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        while context and self._decode(context).startswith(REPLACEMENT_CHAR):
            context.pop(0)
        return context

    # ---- stage 1: ids -> text ------------------------------------------------------------

    def _move_window(self) -> None:
        # The window starts at the latest boundary at least CONTEXT_TOKENS before read_offset
        # (or the oldest known one); boundaries before it are no longer needed.
        read = self._read_offset
        while len(self._boundaries) >= 2 and read - self._boundaries[1] >= CONTEXT_TOKENS:
            self._boundaries.popleft()
        self._prefix_offset = self._boundaries[0]
        if self._prefix_offset >= _COMPACT_AT:
            shift = self._prefix_offset
            del self._ids[:shift]
            self._boundaries = deque(b - shift for b in self._boundaries)
            self._prefix_offset = 0
            self._read_offset -= shift
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])

    def _commit(self, offset: int, window_text: str) -> str:
        """Marks ``ids[:offset]`` as emitted; ``window_text`` is decode(ids[prefix:offset])."""
        piece = window_text[len(self._prefix_text) :]
        self._read_offset = offset
        if offset != self._boundaries[-1]:
            self._boundaries.append(offset)
        self._move_window()
        return piece

    def _find_split(self, window_text: str) -> int | None:
        """The latest offset where the held ids split into final text + an incomplete tail.

        For UTF-8, decode(head) + decode(tail) == decode(head + tail) with a non-empty tail
        holds exactly when no character (or invalid-sequence run) straddles the split; the
        tail's first byte is already known, so such a split never changes later.
        """
        ids = self._ids
        lowest = max(self._read_offset + 1, len(ids) - SPLIT_SEARCH_TOKENS)
        for offset in range(len(ids) - 1, lowest - 1, -1):
            tail = self._decode(ids[offset:])
            if not tail:
                continue
            head = self._decode(ids[self._prefix_offset : offset])
            if head + tail == window_text and head.startswith(self._prefix_text):
                return offset
        return None

    def _decode_new(self, final: bool) -> str:
        """Text of the newly final ids (stage 1); everything left when ``final``."""
        ids = self._ids
        if len(ids) == self._read_offset:
            return ""
        window_text = self._decode(ids[self._prefix_offset :])
        # An incomplete character decodes to U+FFFD at the very end (and a complete valid
        # character cannot be extended), so text not ending in U+FFFD ends on a boundary.
        complete = window_text.startswith(self._prefix_text) and not window_text[
            len(self._prefix_text) :
        ].endswith(REPLACEMENT_CHAR)
        if final or complete:
            return self._commit(len(ids), window_text)
        split = self._find_split(window_text)
        if split is not None:
            return self._commit(split, self._decode(ids[self._prefix_offset : split]))
        if len(ids) - self._read_offset > MAX_HELD_TOKENS:
            return self._commit(len(ids), window_text)
        return ""

    # ---- stage 2: stop strings -----------------------------------------------------------

    def _held_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _apply_stops(self, piece: str) -> str:
        if not self._stops:
            self.text += piece
            return piece
        buf = self._held_stop_text + piece
        # Any match lies within buf: emitted text never ends with the beginning of a stop.
        # The match that completes first wins (as when checking after every token); among
        # those, the one starting first.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            _, start, stop = best
            out = buf[:start]
            self.stopped_by = stop
            self._held_stop_text = ""
        else:
            keep = self._held_prefix_len(buf)
            out = buf[: len(buf) - keep]
            self._held_stop_text = buf[len(buf) - keep :]
        self.text += out
        return out

    # ---- public --------------------------------------------------------------------------

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds output ids; returns the text that became final with them (maybe "")."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self.stopped_by is not None:
            return ""
        self._ids.extend(new_ids)
        return self._apply_stops(self._decode_new(final=False))

    def finish(self) -> str:
        """The request ended: returns everything still held back (nothing after a stop)."""
        if self._finished or self.stopped_by is not None:
            self._finished = True
            return ""
        self._finished = True
        out = self._apply_stops(self._decode_new(final=True))
        if self.stopped_by is None and self._held_stop_text:
            # No more text will come, so a held stop prefix can no longer complete.
            out += self._held_stop_text
            self.text += self._held_stop_text
            self._held_stop_text = ""
        return out
