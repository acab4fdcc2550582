"""Tool calls parsed from a model's text (``--tool-call-parser``), without constrained decoding.

Each parser knows one family's markup of a call and turns generated text into
``(content, calls)``: the text outside the calls, and each call's name and JSON arguments
string. A stream is parsed by :class:`StreamToolParser`: text that may start a call is held
back until it is known not to (so no markup leaks into ``delta.content``), and each call of a
complete block becomes two deltas, its id and name first, then its arguments.

Formats (facts of each family's chat template):

- ``qwen25`` (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>...
  </function>\\n</tool_call>``.
- ``glm45`` (GLM-4.5/4.6): ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
  ...</tool_call>``.
- ``minimax-m2``: ``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="P">V
  </parameter>...</invoke>...</minimax:tool_call>`` (one block may hold several invokes).
- ``deepseekv3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``.

- ``gpt-oss``: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``.

In the XML-like formats a value is a string when the tool's schema says so, else JSON when it
parses as JSON, else the string as written.

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
    """A family's call markup: a block of one or more calls sits between ``start`` and
    ``end``."""

    start: str = ""
    end: str = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # name -> the JSON schema of its parameters' properties (for value types)
        self.props: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            self.props[fn.get("name", "")] = props if isinstance(props, dict) else {}

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        """The calls of one block's inside; None when it is not well-formed."""
        raise NotImplementedError

    def value(self, fn: str, key: str, raw: str) -> Any:
        """A parameter written as text -> its JSON value (see the module's docstring)."""
        schema = self.props.get(fn, {}).get(key)
        if isinstance(schema, dict) and schema.get("type") == "string":
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The whole text -> (the text outside well-formed blocks, the calls in order)."""
        content, calls, pos = [], [], 0
        while True:
            begin = text.find(self.start, pos)
            if begin < 0:
                break
            close = text.find(self.end, begin + len(self.start))
            if close < 0:
                break
            block = self.parse_block(text[begin + len(self.start):close])
            stop = close + len(self.end)
            if block is None:
                content.append(text[pos:stop])
            else:
                content.append(text[pos:begin])
                calls += block
            pos = stop
        content.append(text[pos:])
        return "".join(content), calls


class Qwen25Parser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
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
        return [ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        match = _FUNCTION.search(body)
        if match is None:
            return None
        fn = match.group(1).strip()
        args = {k.strip(): self.value(fn, k.strip(), v.strip("\n"))
                for k, v in _PARAMETER.findall(match.group(2))}
        return [ParsedCall(fn, json.dumps(args, ensure_ascii=False))]


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45Parser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        name, _, rest = body.partition("\n")
        fn = name.strip()
        if not fn or "<" in fn:
            return None
        args = {k.strip(): self.value(fn, k.strip(), v) for k, v in _GLM_ARG.findall(rest)}
        return [ParsedCall(fn, json.dumps(args, ensure_ascii=False))]


_INVOKE = re.compile(r'<invoke name="([^">]+)">(.*?)</invoke>', re.S)
_MINIMAX_PARAM = re.compile(r'<parameter name="([^">]+)">(.*?)</parameter>', re.S)


class MiniMaxM2Parser(ToolParser):
    start, end = "<minimax:tool_call>", "</minimax:tool_call>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        calls = []
        for fn, inner in _INVOKE.findall(body):
            fn = fn.strip()
            args = {k.strip(): self.value(fn, k.strip(), v.strip("\n"))
                    for k, v in _MINIMAX_PARAM.findall(inner)}
            calls.append(ParsedCall(fn, json.dumps(args, ensure_ascii=False)))
        return calls or None


_DEEPSEEK_CALL = re.compile(
    "<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```<｜tool▁call▁end｜>", re.S)


class DeepSeekV3Parser(ToolParser):
    start, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        calls = []
        for _kind, fn, raw in _DEEPSEEK_CALL.findall(body):
            try:
                args = json.loads(raw)
            except ValueError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ParsedCall(fn.strip(), json.dumps(args, ensure_ascii=False)))
        return calls or None


_HARMONY_CALL = re.compile(r"\s*([A-Za-z_][\w.-]*)\s*(?:<\|constrain\|>\s*json\s*)?<\|message\|>(.*)",
                           re.S)


class GptOssParser(ToolParser):
    """gpt-oss (harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{args}<|call|>``. The markers are special tokens: they reach the text only with
    ``skip_special_tokens: false``; the other channels' text stays in ``content`` as written."""

    start, end = "<|channel|>commentary to=", "<|call|>"

    def parse_block(self, body: str) -> list[ParsedCall] | None:
        match = _HARMONY_CALL.match(body)
        if match is None:
            return None
        try:
            args = json.loads(match.group(2)) if match.group(2).strip() else {}
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        name = match.group(1).rsplit(".", 1)[-1]  # functions.NAME -> NAME
        return [ParsedCall(name, json.dumps(args, ensure_ascii=False))]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen25": Qwen25Parser,
    "qwen3_coder": Qwen3CoderParser,
    "glm45": Glm45Parser,
    "minimax-m2": MiniMaxM2Parser,
    "deepseekv3": DeepSeekV3Parser,
    "gpt-oss": GptOssParser,
}


def get_tool_parser(name: str | None,
                    tools: list[dict[str, Any]] | None = None) -> ToolParser | None:
    if not name:
        return None
    try:
        return TOOL_PARSERS[name](tools)
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
            block = p.parse_block(self.buffer[begin + len(p.start):close])
            if block is None:
                content.append(self.buffer[:stop])
            else:
                content.append(self.buffer[:begin])
                for call in block:
                    deltas.append({"index": self.count, "id": new_call_id(),
                                   "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
                    deltas.append({"index": self.count,
                                   "function": {"arguments": call.arguments}})
                    self.count += 1
            self.buffer = self.buffer[stop:]
        return "".join(content), deltas
