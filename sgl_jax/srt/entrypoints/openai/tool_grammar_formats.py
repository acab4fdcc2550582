"""One Lark grammar (llguidance's dialect) per ``--tool-call-parser``: exactly one call, to one
of the given tools, in the markup that parser reads (``tool_parsers.py``; the formats are
those of the families' chat templates), its arguments matching the tool's ``parameters``.

- JSON formats (``qwen25``, ``deepseekv3``, ``gpt-oss``): the arguments are ``%json`` of the
  whole ``parameters`` schema (``qwen25``: the ``{"name", "arguments"}`` object).
- XML-like formats (``qwen3_coder``, ``glm45``, ``minimax-m2``): one element per property, in
  the schema's order (required ones always, the others optional, none twice); a value is
  JSON matching the property's schema, except a ``string`` property's, which the parsers read
  raw (``ToolParser.value``): one of its ``enum`` / ``const`` strings, else one line without
  ``<`` (so it cannot close its element; ``minLength`` / ``maxLength`` kept, other string
  keywords not enforced).

Invariant: every string a grammar accepts is parsed by the same-named parser into one call of a
declared tool whose arguments match the schema (tests/test_tool_grammars.py checks it by
random walks over the grammar's token masks). Known gaps: a JSON string value may itself
contain the format's end marker (the parser would cut the block there), and an XML-like
format writes no property of a ``parameters`` schema without ``properties``.

``special``: the markers that are special tokens in the served tokenizer, by id; a grammar
names those tokens (``<[id]>``) instead of spelling the marker's text with ordinary tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from sgl_jax.srt.entrypoints.openai.protocol import Tool

Special = Mapping[str, int]  # marker text -> its special token's id
Builder = Callable[[list[Tool], Special], str]

# JSON exactly as the families write it, no other whitespace (a weak model would otherwise
# spend its tokens on whitespace).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_HEADER = "%llguidance {}\n"


def _lit(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _seq(special: Special, *parts: str) -> str:
    """Literal ``parts`` in order, a special marker as its token, the other text as a string."""
    return " ".join(f"<[{special[p]}]>" if p in special else _lit(p) for p in parts if p)


def _json(schema: Any) -> str:
    """``%json`` of ``schema`` (one line), compact."""
    schema = schema if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**schema, 'x-guidance': _COMPACT})}"


def _params(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters
    return params if isinstance(params, dict) else {"type": "object"}


def _raw_value(schema: Any) -> str:
    """A property's value as the XML-like parsers read it (see the module's docstring)."""
    if not (isinstance(schema, dict) and schema.get("type") == "string"):
        return _json(schema)
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema \
        else None
    if choices is not None:
        strings = [c for c in choices if isinstance(c, str) and "\n" not in c]
        if not strings:  # no string the parser would read back as one of them: let it fail
            return '/[^\\s\\S]/'
        return "(" + " | ".join(_lit(c) for c in strings) + ")"
    least, most = schema.get("minLength"), schema.get("maxLength")
    least = int(least) if isinstance(least, int) else 0
    count = f"{{{least},{int(most)}}}" if isinstance(most, int) else f"{{{least},}}"
    return f"/[^<\\n]{count}/"


def _xml_calls(tools: list[Tool], head: Callable[[str], list[str]],
               param: Callable[[str], tuple[list[str], list[str]]], tail: list[str],
               special: Special) -> tuple[str, list[str]]:
    """Per tool a rule ``f{i}``: ``head(name)``, its properties (``param(key)``: the text
    before and after the value), then ``tail``; -> (the alternatives, the rules)."""
    rules = []
    for i, tool in enumerate(tools):
        params = _params(tool)
        props = params.get("properties")
        props = props if isinstance(props, dict) else {}
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            before, after = param(key)
            rules.append(f"p{i}_{j}: {_seq(special, *before)} {_raw_value(schema)} "
                         f"{_seq(special, *after)}")
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"f{i}: {_seq(special, *head(tool.function.name))} {' '.join(parts)} "
                     f"{_seq(special, *tail)}")
    return " | ".join(f"f{i}" for i in range(len(tools))), rules


def _json_calls(tools: list[Tool], head: Callable[[str], list[str]], tail: list[str],
                special: Special) -> tuple[str, list[str]]:
    """Per tool a rule ``f{i}``: ``head(name)``, the arguments as JSON, then ``tail``."""
    rules = [f"f{i}: {_seq(special, *head(t.function.name))} {_json(_params(t))} "
             f"{_seq(special, *tail)}" for i, t in enumerate(tools)]
    return " | ".join(f"f{i}" for i in range(len(tools))), rules


def _grammar(before: list[str], calls: str, rules: list[str], after: list[str],
             special: Special) -> str:
    start = " ".join(x for x in (_seq(special, *before), "call", _seq(special, *after)) if x)
    return _HEADER + f"start: {start}\ncall: {calls}\n" + "\n".join(rules) + "\n"


def qwen25(tools: list[Tool], special: Special) -> str:
    """``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``."""
    schemas = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": _params(t)},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return _grammar(["<tool_call>", "\n"], _json(schema), [], ["\n", "</tool_call>"], special)


def qwen3_coder(tools: list[Tool], special: Special) -> str:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n</parameter>\\n...</function>
    \\n</tool_call>``."""
    calls, rules = _xml_calls(
        tools, lambda name: [f"<function={name}>\n"],
        lambda key: ([f"<parameter={key}>\n"], ["\n</parameter>\n"]), ["</function>"], special)
    return _grammar(["<tool_call>", "\n"], calls, rules, ["\n", "</tool_call>"], special)


def glm45(tools: list[Tool], special: Special) -> str:
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``
    (GLM-4.5's template; the markers are special tokens in GLM's tokenizer)."""
    calls, rules = _xml_calls(
        tools, lambda name: [name, "\n"],
        lambda key: (["<arg_key>", key, "</arg_key>", "\n", "<arg_value>"],
                     ["</arg_value>", "\n"]), [], special)
    return _grammar(["<tool_call>"], calls, rules, ["</tool_call>"], special)


def minimax_m2(tools: list[Tool], special: Special) -> str:
    """``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n...
    </invoke>\\n</minimax:tool_call>``."""
    calls, rules = _xml_calls(
        tools, lambda name: [f'<invoke name="{name}">\n'],
        lambda key: ([f'<parameter name="{key}">'], ["</parameter>\n"]), ["</invoke>\n"],
        special)
    return _grammar(["<minimax:tool_call>", "\n"], calls, rules, ["</minimax:tool_call>"],
                    special)


def deepseekv3(tools: list[Tool], special: Special) -> str:
    """``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS
    \\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>``."""
    calls, rules = _json_calls(
        tools, lambda name: ["<｜tool▁call▁begin｜>", "function", "<｜tool▁sep｜>",
                             f"{name}\n```json\n"],
        ["\n```", "<｜tool▁call▁end｜>"], special)
    return _grammar(["<｜tool▁calls▁begin｜>"], calls, rules, ["<｜tool▁calls▁end｜>"], special)


def gpt_oss(tools: list[Tool], special: Special) -> str:
    """``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``
    (harmony; the markers are special tokens in gpt-oss's tokenizer)."""
    calls, rules = _json_calls(
        tools, lambda name: [f"commentary to=functions.{name} ", "<|constrain|>", "json",
                             "<|message|>"], ["<|call|>"], special)
    return _grammar(["<|channel|>"], calls, rules, [], special)


GRAMMARS: dict[str, Builder] = {
    "qwen25": qwen25, "qwen3_coder": qwen3_coder, "glm45": glm45, "minimax-m2": minimax_m2,
    "deepseekv3": deepseekv3, "gpt-oss": gpt_oss}

# Every marker text a grammar above may write as one special token (the served tokenizer
# decides which of them are special).
MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
           "</arg_value>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|channel|>", "<|constrain|>",
           "<|message|>", "<|call|>")
