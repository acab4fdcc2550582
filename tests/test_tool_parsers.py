"""Tool-call parsers (``--tool-call-parser``): whole texts and the same texts streamed in
pieces of every size give the same calls and content; malformed calls stay text.

Expected values are written from each family's documented markup, not from parser output.
"""

from __future__ import annotations

import json

import pytest

from sgl_jax.srt.entrypoints.openai.tool_parsers import (
    StreamToolParser,
    get_tool_parser,
)

QWEN25 = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
          '</tool_call>')
QWEN3_CODER = ('Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
               '</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>')
GLM45 = ('Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris'
         '</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>')
MINIMAX = ('ok\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
           '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="add">'
           '\n<parameter name="a">1</parameter>\n</invoke>\n</minimax:tool_call>')
DEEPSEEK = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather'
            '\n```json\n{"city": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
            '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
            '<｜tool▁calls▁end｜>')
GPT_OSS = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
           '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Paris"}<|call|>')
# The schema says "zip" is a string: "75001" stays text, as written.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]
CASES = {
    "gpt-oss": (GPT_OSS, "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>"
                "assistant", [("get_weather", {"city": "Paris"})]),
    "glm45": (GLM45, "Let me look.", [("get_weather", {"city": "Paris", "zip": "75001"})]),
    "minimax-m2": (MINIMAX, "ok\n", [("get_weather", {"city": "Paris", "days": 3}),
                                     ("add", {"a": 1})]),
    "deepseekv3": (DEEPSEEK, "Checking.", [("get_weather", {"city": "Tokyo"}),
                                           ("get_weather", {"city": "Paris"})]),
    "qwen25": (QWEN25, "I will check. \n", [("get_weather", {"city": "Paris"}),
                                            ("add", {"a": 1, "b": 2})]),
    "qwen3_coder": (QWEN3_CODER, "Sure.", [("get_weather", {"city": "Paris", "days": 3})]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_whole_text(name):
    text, content, calls = CASES[name]
    got_content, got = get_tool_parser(name, TOOLS).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def stream(name: str, text: str, size: int, clean: bool = False) -> tuple[str, list[dict]]:
    """``clean``: the text's only markup is well-formed calls, none may reach content."""
    parser = StreamToolParser(get_tool_parser(name, TOOLS))
    content, deltas = "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        c, d = parser.feed(piece, final=i == len(pieces) - 1)
        assert not clean or ("tool" not in c and "</" not in c and "<|call|>" not in c
                             and "commentary" not in c)
        content += c
        deltas += d
    return content, deltas


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_in_pieces(name, size):
    text, content, calls = CASES[name]
    got_content, deltas = stream(name, text, size, clean=True)
    assert got_content == content
    # Per call: first its id, type and name (empty arguments), then its arguments.
    assert len(deltas) == 2 * len(calls)
    for i, (fn, args) in enumerate(calls):
        head, tail = deltas[2 * i], deltas[2 * i + 1]
        assert head["index"] == tail["index"] == i
        assert head["id"].startswith("call_") and head["type"] == "function"
        assert head["function"] == {"name": fn, "arguments": ""}
        assert "id" not in tail and json.loads(tail["function"]["arguments"]) == args


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call> after",
    "<tool_call>\n[1, 2]\n</tool_call>",
    "an unfinished <tool_call>\n{\"name\": \"f\"",
    "a < b and <tool_ is not a call",
])
def test_malformed_calls_stay_text(text):
    content, calls = get_tool_parser("qwen25").parse(text)
    assert (content, calls) == (text, [])
    for size in (1, 4, 1000):
        assert stream("qwen25", text, size) == (text, [])


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen25"):
        get_tool_parser("nope")


def test_the_server_flags_name_every_parser():
    """--tool-call-parser / --reasoning-parser offer exactly the registered parsers."""
    from sgl_jax.srt.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from sgl_jax.srt.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from sgl_jax.srt.server_args_checks import REASONING_PARSERS as REASONING_FLAG
    from sgl_jax.srt.server_args_checks import TOOL_CALL_PARSERS

    assert TOOL_CALL_PARSERS == tuple(TOOL_PARSERS)
    assert REASONING_FLAG == tuple(REASONING_PARSERS)
