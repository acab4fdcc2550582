"""``tool_choice`` "required" / a named function, enforced by a grammar: the output must be
one call in the markup the ``--tool-call-parser`` reads, with arguments that match the tool's
``parameters`` schema. So even a model that would never call a tool returns a valid call
(OpenAI's semantics of these choices), parsed into ``message.tool_calls``. Every parser has a
grammar (``tool_grammar_formats.py``).
"""

from __future__ import annotations

from sgl_jax.srt.entrypoints.openai.protocol import NamedToolChoice, OpenAIError, Tool
from sgl_jax.srt.entrypoints.openai.tool_grammar_formats import GRAMMARS, MARKERS, Special
from sgl_jax.srt.tokenizer import Tokenizer


def special_markers(tokenizer: Tokenizer) -> dict[str, int]:
    """The call markers that are special tokens in ``tokenizer`` (by id)."""
    ids = {m: tokenizer.token_to_id(m) for m in MARKERS}
    return {m: i for m, i in ids.items() if i is not None and i in tokenizer.all_special_ids}


def tool_call_grammar(tools: list[Tool], choice: str | NamedToolChoice, parser: str,
                      special: Special | None = None) -> str | None:
    """The Lark grammar of one call that ``choice`` allows, or None when ``choice`` asks for
    no constraint ("auto", "none"). OpenAIError (400) for a name no tool has, or a parser
    without a grammar. ``special``: the markers that are special tokens (``special_markers``)."""
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
    return GRAMMARS[parser](chosen, special or {})
