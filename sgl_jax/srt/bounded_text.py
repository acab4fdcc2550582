"""Bounded text for error messages built from untrusted input.

A config.json or a checkpoint is operator input, but an error about it travels back to an HTTP
client and into the logs: a value of a megabyte, or a list of a million missing tensors, must
not become a megabyte-sized message. Every message that quotes such input goes through these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import islice
from typing import Any

MAX_MESSAGE_CHARS = 2000  # a whole error message (an HTTP 400 body stays well under 4 KB)
MAX_LOGGED_CHARS = 200  # one client-controlled value (a path, a rid, a model name) in a log line

# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators: each could end a
# log line early, forge the next one, or drive a terminal (ESC sequences).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters with a note of the full length.

    Containers are summarised by length before their repr is built, so a tuple of a million
    items does not cost a million-item repr."""
    if isinstance(value, (list, tuple, dict, set, frozenset)) and len(value) > limit:
        kind = type(value).__name__
        head = list(islice(value.items() if isinstance(value, dict) else value, 4))
        return f"<{kind} of {len(value)} items, starting {_cut(repr(head), limit)}>"
    return _cut(repr(value), limit)


def name_list(names: Iterable[Any], shown: int = 5, each: int = 120, quote: bool = True) -> str:
    """The first ``shown`` names (each cut to ``each`` characters; as reprs if ``quote``),
    then "and N more"."""
    names = list(names)
    text = ", ".join(short_repr(n, each) if quote else _cut(str(n), each)
                     for n in names[:shown])
    if len(names) > shown:
        text += f" and {len(names) - shown} more"
    return text


def bound_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return _cut(text, limit)


def log_safe(value: Any, limit: int = MAX_LOGGED_CHARS) -> str:
    """``value`` fit for one log line: cut to ``limit`` characters (before escaping, so a
    60k-character path costs no 60k-character work beyond the cut), then every control
    character written as an escape (``\\n``, ``\\x1b``, ``\\x00``), so client input can
    neither start a forged line nor send a terminal escape. Use it for every
    client-controlled string that reaches a log line."""
    text = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(_escape, _cut(text, limit))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters in all)"
