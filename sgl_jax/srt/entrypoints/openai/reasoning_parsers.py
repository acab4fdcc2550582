"""Reasoning split from the answer (``--reasoning-parser``): ``<think>...</think>`` becomes
``reasoning_content``, the rest ``content``.

- ``qwen3``: the model opens its reasoning itself: the text is reasoning only when it begins
  with ``<think>`` (leading whitespace aside), up to ``</think>``.
- ``deepseek-r1``: the chat template already opened it, so the text is reasoning from its
  start (a ``<think>`` there is dropped) up to ``</think>``.

Without ``</think>`` (the output was cut) everything after the opening is reasoning. The
whitespace right after ``</think>`` is dropped from the content.

Streamed (:class:`StreamReasoning`), reasoning goes out as it comes (``stream_reasoning``,
the default) or, with ``stream_reasoning: false``, in one piece when it ends.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    opens_itself = True  # qwen3: only text that begins with <think> is reasoning

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole text -> (reasoning or None, content)."""
        body = text.lstrip()
        if body.startswith(OPEN):
            body = body[len(OPEN):]
        elif self.opens_itself:
            return None, text
        reasoning, closed, rest = body.partition(CLOSE)
        if not closed:
            return reasoning, ""
        return reasoning, rest.lstrip()


class DeepSeekR1Parser(ReasoningParser):
    opens_itself = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ReasoningParser,
    "deepseek-r1": DeepSeekR1Parser,
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name:
        return None
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r}: use one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


class StreamReasoning:
    """One streamed choice: text pieces -> (reasoning piece, content piece)."""

    def __init__(self, parser: ReasoningParser, stream_reasoning: bool = True) -> None:
        self.parser = parser
        self.stream_reasoning = stream_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.buffer = ""  # text not yet classified
        self.held = ""  # reasoning held back (stream_reasoning off)
        self.strip_next = False  # drop whitespace after </think>

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        if self.state == "start":
            body = self.buffer.lstrip()
            if body.startswith(OPEN):
                self.buffer = body[len(OPEN):]
                self.state = "reasoning"
            elif OPEN.startswith(body) and not final:
                return "", ""  # may still become <think>
            elif self.parser.opens_itself:
                self.state = "content"
            else:
                self.buffer, self.state = body, "reasoning"
        if self.state == "reasoning":
            idx = self.buffer.find(CLOSE)
            if idx >= 0:
                reasoning = self.buffer[:idx]
                self.buffer = self.buffer[idx + len(CLOSE):]
                self.state, self.strip_next = "content", True
            else:
                keep = 0 if final else _held_suffix(self.buffer, CLOSE)
                reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
            if not self.stream_reasoning:
                self.held += reasoning
                reasoning = ""
                if self.state == "content" or final:
                    reasoning, self.held = self.held, ""
        if self.state == "content":
            if self.strip_next:
                self.buffer = self.buffer.lstrip()
                self.strip_next = not self.buffer
            content, self.buffer = self.buffer, ""
        return reasoning, content


def _held_suffix(text: str, marker: str) -> int:
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
