"""``tool_choice`` "required" / a named function, enforced by a grammar: the output must be
one call in the markup the ``--tool-call-parser`` reads, with arguments that match the tool's
``parameters`` schema. So even a model that would never call a tool returns a valid call
(OpenAI's semantics of these choices), parsed into ``message.tool_calls``.

Only ``qwen25``'s markup (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``)
has a grammar; for the other parsers these choices are refused with a 400 naming the parser.
"""

from __future__ import annotations

import json
from typing import Any

from sgl_jax.srt.entrypoints.openai.protocol import NamedToolChoice, OpenAIError, Tool

GRAMMAR_PARSERS = ("qwen25",)


def _call_schema(tool: Tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[Tool], choice: str | NamedToolChoice,
                      parser: str) -> str | None:
    """The Lark grammar of one call that ``choice`` allows, or None when ``choice`` asks for
    no constraint ("auto", "none"). OpenAIError (400) for a name no tool has, or a parser
    without a grammar."""
    if not isinstance(choice, NamedToolChoice) and choice != "required":
        return None
    if parser not in GRAMMAR_PARSERS:
        raise OpenAIError(
            400, f"tool_choice 'required' or a named function is enforced with a grammar of "
            f"the tool-call markup, which --tool-call-parser {parser} does not have (only "
            f"{', '.join(GRAMMAR_PARSERS)}); use 'auto'", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise OpenAIError(400, f"tool_choice names function {choice.function.name!r}, "
                              f"which no tool in 'tools' is", param="tool_choice")
    else:
        chosen = tools
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # The markup as the parser's family writes it: {"name": "f", "arguments": {...}}; no other
    # whitespace (a random model would otherwise spend its tokens on it).
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ",
                            "key_separator": ": "}
    # %json embeds a JSON schema in Lark (llguidance's syntax); the schema is one line of JSON.
    return ("%llguidance {}\n"
            'start: "<tool_call>\\n" call "\\n</tool_call>"\n'
            f"call: %json {json.dumps(schema)}\n")
