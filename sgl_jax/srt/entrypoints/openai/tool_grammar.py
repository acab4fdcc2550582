"""``tool_choice`` "required" / a named function, enforced by a grammar: the output must be
one call in the markup the ``--tool-call-parser`` reads, with arguments that match the tool's
``parameters`` schema. So even a model that would never call a tool returns a valid call
(OpenAI's semantics of these choices), parsed into ``message.tool_calls``.

Grammars (llguidance's Lark, with ``%json`` for JSON that matches a schema) exist for:

- ``qwen25``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, the
  arguments matching the whole ``parameters`` schema;
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  ...</function>\\n</tool_call>``, the schema's properties in its order (required ones
  always, the others optional), each value JSON matching the property's schema, except a
  ``string`` property's, which is written raw as the parser reads it: one line without ``<``
  (its ``maxLength`` kept, other string keywords not enforced).

For the other parsers these choices are refused with a 400 naming the parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sgl_jax.srt.entrypoints.openai.protocol import NamedToolChoice, OpenAIError, Tool

# JSON exactly as the families write it, no other whitespace (a weak model would otherwise
# spend its tokens on whitespace).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict[str, Any]) -> str:
    """``%json`` of ``schema`` (one line), compact."""
    return f"%json {json.dumps({**schema, 'x-guidance': _COMPACT})}"


def _qwen25(tools: list[Tool]) -> str:
    schemas = [{"type": "object",
                "properties": {"name": {"const": t.function.name},
                               "arguments": t.function.parameters or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return ("%llguidance {}\n"
            'start: "<tool_call>\\n" call "\\n</tool_call>"\n'
            f"call: {_json(schema)}\n")


def _qwen3_coder_value(schema: Any) -> str:
    if isinstance(schema, dict) and schema.get("type") == "string":
        most = schema.get("maxLength")
        count = f"{{0,{int(most)}}}" if isinstance(most, int) else "*"
        return f"/[^<\\n]{count}/"
    return _json(schema if isinstance(schema, dict) else {})


def _qwen3_coder(tools: list[Tool]) -> str:
    rules = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            rules.append(f'p{i}_{j}: {json.dumps(f"<parameter={key}>" + chr(10))} '
                         f'{_qwen3_coder_value(schema)} "\\n</parameter>\\n"')
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        head = json.dumps(f"<function={tool.function.name}>\n")
        rules.append(f'f{i}: {head} {" ".join(parts)} "</function>"')
    calls = " | ".join(f"f{i}" for i in range(len(tools)))
    return ("%llguidance {}\n"
            'start: "<tool_call>\\n" call "\\n</tool_call>"\n'
            f"call: {calls}\n" + "\n".join(rules) + "\n")


GRAMMARS: dict[str, Callable[[list[Tool]], str]] = {"qwen25": _qwen25,
                                                     "qwen3_coder": _qwen3_coder}


def tool_call_grammar(tools: list[Tool], choice: str | NamedToolChoice,
                      parser: str) -> str | None:
    """The Lark grammar of one call that ``choice`` allows, or None when ``choice`` asks for
    no constraint ("auto", "none"). OpenAIError (400) for a name no tool has, or a parser
    without a grammar."""
    if not isinstance(choice, NamedToolChoice) and choice != "required":
        return None
    if parser not in GRAMMARS:
        raise OpenAIError(
            400, f"tool_choice 'required' or a named function is enforced with a grammar of "
            f"the tool-call markup, which --tool-call-parser {parser} does not have (only "
            f"{', '.join(GRAMMARS)}); use 'auto'", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise OpenAIError(400, f"tool_choice names function {choice.function.name!r}, "
                              f"which no tool in 'tools' is", param="tool_choice")
    else:
        chosen = tools
    return GRAMMARS[parser](chosen)
