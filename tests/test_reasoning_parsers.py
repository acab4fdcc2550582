"""Reasoning parsers (``--reasoning-parser``): whole texts and the same texts streamed in
pieces of every size split into the same reasoning and content.

Expected values are written from the families' documented markup (``<think>...</think>``).
"""

from __future__ import annotations

import pytest

from sgl_jax.srt.entrypoints.openai.reasoning_parsers import (
    StreamReasoning,
    get_reasoning_parser,
)

CASES = [
    # (parser, text, reasoning, content)
    ("qwen3", "<think>\nstep one\n</think>\n\nThe answer.", "\nstep one\n", "The answer."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off mid", "cut off mid", ""),
    ("deepseek-r1", "step one</think>The answer.", "step one", "The answer."),
    ("deepseek-r1", "<think>step</think>\nok", "step", "ok"),
    ("deepseek-r1", "all reasoning, cut", "all reasoning, cut", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_whole_text(name, text, reasoning, content):
    assert get_reasoning_parser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_streamed_in_pieces(name, text, reasoning, content, size, stream_reasoning):
    split = StreamReasoning(get_reasoning_parser(name), stream_reasoning)
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    got_r, got_c, reasoning_chunks = "", "", 0
    for i, piece in enumerate(pieces):
        r, c = split.feed(piece, final=i == len(pieces) - 1)
        assert "<think>" not in r + c and "</think>" not in r + c
        got_r += r
        got_c += c
        reasoning_chunks += bool(r)
    assert got_r == (reasoning or "") and got_c == content
    if not stream_reasoning and reasoning:
        assert reasoning_chunks == 1  # in one piece, when it ends


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
