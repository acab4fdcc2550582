"""tool_choice "required" / named grammars (``tool_grammar_formats.py``), one per
``--tool-call-parser``: each accepts a hand-written call in the format, which the same-named
parser reads back as the expected call; refuses calls that break the schema; and random token
walks over its masks (the bundled tokenizer, llguidance's matcher as the scheduler builds it)
always end in text the parser reads as one call of a declared tool with schema-valid arguments
(checked by ``tests.test_structured_output.matches``, an independent validator)."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from llguidance.numpy import fill_next_token_bitmask

from sgl_jax.srt.constrained.grammar import GrammarCompiler, llg_tokenizer, parser_limits
from sgl_jax.srt.constrained.matchers import mask_words
from sgl_jax.srt.entrypoints.openai.protocol import NamedToolChoice, OpenAIError, Tool
from sgl_jax.srt.entrypoints.openai.tool_grammar import special_markers, tool_call_grammar
from sgl_jax.srt.entrypoints.openai.tool_grammar_formats import GRAMMARS
from sgl_jax.srt.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.testing import ensure_test_model
from tests.test_structured_output import matches

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get-time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
                                             "exact": {"type": "boolean"}},
            "required": ["zone"], "additionalProperties": False}}},
]
ARGS = {"city": "Paris", "days": 3}

# parser -> (a call of get_weather(ARGS) as the family writes it, calls that break the schema)
CASES = {
    "qwen25": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n'
         "</tool_call>", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>']),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n12\n</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
         "\n</tool_call>"]),
    "glm45": (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>0</arg_value>\n</tool_call>",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>unit</arg_key>\n"
         "<arg_value>K</arg_value>\n</tool_call>"]),
    "minimax-m2": (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
        '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
        ['<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Marseille'
         '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>',
         '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">3'
         '</parameter>\n<parameter name="city">Paris</parameter>\n</invoke>\n'
         '</minimax:tool_call>']),
    "deepseekv3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>']),
    "gpt-oss": (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "days": 3}<|call|>',
        ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Paris", "days": 3, "x": 1}<|call|>',
         '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>'
         '{"zone": "UTC"}<|call|>']),
}
WALKS = 6  # random walks per parser and choice


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_test_model())


@pytest.fixture(scope="module")
def lt(tok: Tokenizer) -> llguidance.LLTokenizer:
    return llg_tokenizer(tok, len(tok), list(tok.eos_token_ids))


@pytest.fixture(scope="module")
def compiler(lt: llguidance.LLTokenizer) -> GrammarCompiler:
    return GrammarCompiler(lt)


def _grammar(compiler: GrammarCompiler, parser: str, choice="required") -> str:
    tools = [Tool.model_validate(t) for t in TOOLS]
    return compiler.compile("ebnf", tool_call_grammar(tools, choice, parser))


def test_every_parser_has_a_grammar():
    assert set(GRAMMARS) == set(TOOL_PARSERS)


@pytest.mark.parametrize("parser", sorted(CASES))
def test_grammar_accepts_its_parsers_markup_and_refuses_schema_breaks(parser, tok, lt,
                                                                      compiler):
    good, bad = CASES[parser]
    grammar = _grammar(compiler, parser)

    def accepted(text: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepted(good)
    for b in bad:
        assert not accepted(b), b
    _, calls = get_tool_parser(parser, TOOLS).parse(good)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]


def _walk(lt: llguidance.LLTokenizer, grammar: str, rng: np.random.Generator,
          eos: set[int], limit: int = 400) -> list[int]:
    """Tokens drawn uniformly from the grammar's mask (the scheduler's matcher and mask
    layout) until the end of sequence is drawn or the grammar stops."""
    m = llguidance.LLMatcher(lt, grammar, log_level=0, limits=parser_limits())
    words = np.zeros((1, mask_words(lt.vocab_size)), np.int32)
    out: list[int] = []
    for _ in range(limit):
        fill_next_token_bitmask(m, words, 0)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:lt.vocab_size]
        token = int(rng.choice(np.flatnonzero(bits)))
        if token in eos:
            assert m.is_accepting()
            return out
        assert m.consume_token(token), m.get_error()
        out.append(token)
        if m.is_stopped():
            return out
    raise AssertionError(f"no end after {limit} tokens")


@pytest.mark.parametrize("parser", sorted(CASES))
def test_random_walks_parse_as_valid_calls(parser, tok, lt, compiler):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = np.random.default_rng(0)
    eos = set(tok.eos_token_ids)
    for choice in ("required", NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "get-time"}})):
        grammar = _grammar(compiler, parser, choice)
        for _ in range(WALKS):
            text = tok.decode(_walk(lt, grammar, rng, eos))
            content, calls = get_tool_parser(parser, TOOLS).parse(text)
            assert content == "" and len(calls) == 1, text
            (call,) = calls
            assert call.name in schemas, text
            if choice != "required":
                assert call.name == "get-time"
            assert matches(json.loads(call.arguments), schemas[call.name]), text


def test_special_markers_become_tokens(tok, lt):
    """A marker the tokenizer holds as a special token is named as that token, so the model
    writes it as it was trained to; the bundled tokenizer has none of the markers."""
    assert special_markers(tok) == {}
    tools = [Tool.model_validate(t) for t in TOOLS]
    grammar = tool_call_grammar(tools, "required", "qwen25", {"</tool_call>": 511})
    assert "<[511]>" in grammar and '"</tool_call>"' not in grammar
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert m.consume_tokens(tok.encode(CASES["qwen25"][0][:-len("</tool_call>")],
                                       add_special_tokens=False) + [511])
    assert m.is_accepting()


HARMONY = ["<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]


def test_harmony_markers_as_special_tokens_round_trip(tmp_path):
    """A tokenizer holding harmony's markers as special tokens (gpt-oss's): the grammar names
    them, a walk writes each as its one token, and the text decoded with
    ``skip_special_tokens: false`` (what serving_chat asks for then) parses as a valid call."""
    import shutil

    src = ensure_test_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"] += [{"id": 512 + i, "content": m, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True} for i, m in enumerate(HARMONY)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_pretrained(str(tmp_path))
    special = special_markers(tok)
    assert special == {m: 512 + i for i, m in enumerate(HARMONY)}
    lt = llg_tokenizer(tok, len(tok), list(tok.eos_token_ids))
    tools = [Tool.model_validate(t) for t in TOOLS]
    grammar = GrammarCompiler(lt).compile(
        "ebnf", tool_call_grammar(tools, "required", "gpt-oss", special))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = np.random.default_rng(1)
    for _ in range(WALKS):
        ids = _walk(lt, grammar, rng, set(tok.eos_token_ids))
        assert set(special.values()) <= set(ids)
        _, calls = get_tool_parser("gpt-oss", TOOLS).parse(
            tok.decode(ids, skip_special_tokens=False))
        (call,) = calls
        assert matches(json.loads(call.arguments), schemas[call.name])


def test_a_name_no_tool_has_is_400():
    tools = [Tool.model_validate(t) for t in TOOLS]
    assert tool_call_grammar(tools, "auto", "glm45") is None
    with pytest.raises(OpenAIError, match="names function 'nope'"):
        tool_call_grammar(tools, NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": "nope"}}), "glm45")
