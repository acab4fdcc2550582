"""Tool calls parsed from a model's text (``--tool-call-parser``), without constrained decoding.

Each parser knows one family's markup of a call and turns generated text into
``(content, calls)``: the text outside the calls, and each call's name and JSON arguments
string. A stream is parsed by :class:`StreamToolParser`: text that may start a call is held
back until it is known not to (so no markup leaks into ``delta.content``), and each complete
call becomes two deltas, its id and name first, then its arguments.

Formats (facts of each family's chat template):

- ``qwen25`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>...
  </function>\\n</tool_call>`` (a value is JSON when it parses as JSON, else a string).

A call whose body does not parse stays in ``content`` as text, as it was generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """A family's call markup: calls sit between ``start`` and ``end``."""

    start: str = ""
    end: str = ""

    def parse_body(self, body: str) -> ParsedCall | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The whole text -> (the text outside well-formed calls, the calls in order)."""
        content, calls, pos = [], [], 0
        while True:
            begin = text.find(self.start, pos)
            if begin < 0:
                break
            close = text.find(self.end, begin + len(self.start))
            if close < 0:
                break
            call = self.parse_body(text[begin + len(self.start):close])
            stop = close + len(self.end)
            if call is None:
                content.append(text[pos:stop])
            else:
                content.append(text[pos:begin])
                calls.append(call)
            pos = stop
        content.append(text[pos:])
        return "".join(content), calls


class Qwen25Parser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_body(self, body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments already as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_body(self, body: str) -> ParsedCall | None:
        match = _FUNCTION.search(body)
        if match is None:
            return None
        args: dict[str, Any] = {}
        for name, raw in _PARAMETER.findall(match.group(2)):
            value = raw.strip("\n")
            try:
                args[name.strip()] = json.loads(value)
            except ValueError:
                args[name.strip()] = value
        return ParsedCall(match.group(1).strip(), json.dumps(args, ensure_ascii=False))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": Qwen25Parser,
    "qwen3_coder": Qwen3CoderParser,
}


def get_tool_parser(name: str | None) -> ToolParser | None:
    if not name:
        return None
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r}: use one of "
                         f"{', '.join(TOOL_PARSERS)}") from None


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (may grow into it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class StreamToolParser:
    """One streamed choice's text -> content deltas and tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.count = 0  # calls emitted so far (their delta index)

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New text -> (content to send now, tool-call deltas). ``final``: flush everything."""
        self.buffer += text
        content, deltas = [], []
        p = self.parser
        while True:
            begin = self.buffer.find(p.start)
            if begin < 0:
                keep = 0 if final else _held_suffix(self.buffer, p.start)
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            close = self.buffer.find(p.end, begin + len(p.start))
            if close < 0:
                content.append(self.buffer[:begin])
                self.buffer = self.buffer[begin:]
                if final:  # an unfinished call: what was generated, as text
                    content.append(self.buffer)
                    self.buffer = ""
                break
            stop = close + len(p.end)
            call = p.parse_body(self.buffer[begin + len(p.start):close])
            if call is None:
                content.append(self.buffer[:stop])
            else:
                content.append(self.buffer[:begin])
                deltas.append({"index": self.count, "id": new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                deltas.append({"index": self.count, "function": {"arguments": call.arguments}})
                self.count += 1
            self.buffer = self.buffer[stop:]
        return "".join(content), deltas
