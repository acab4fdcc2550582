"""Constrained decoding (docs/openai.md): json_schema, regex, ebnf, response_format and
tool_choice required / named through the official client against a real server (the bundled
random-weight model, which on its own never writes JSON or a tool call), checked with
independent references (``json``, ``re``, a small schema validator); bad grammars are 400s
and the server serves afterwards. The device mask apply is checked against a numpy unpack.
"""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import openai
import pytest
import requests

from sgl_jax.srt.layers.sampler import apply_vocab_mask
from sgl_jax.testing import server_flags
from tests.server_utils import server_fixture

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b", "c"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
            "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Describe a person."}]


def matches(value: object, schema: dict) -> bool:
    """A small JSON-schema check of the keywords used here (an independent reference)."""
    if "enum" in schema:
        return value in schema["enum"]
    if "const" in schema:
        return value == schema["const"]
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(matches(value[k], s) for k, s in props.items() if k in value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -1 << 62) <= value <= schema.get("maximum", 1 << 62))
    if kind == "boolean":
        return isinstance(value, bool)
    return True


@pytest.fixture(scope="module")
def server(request):
    # A small KV cache admitted optimistically: test_retraction_replays_the_matcher retracts.
    yield from server_fixture(request, server_flags(
        constrained_json_disable_any_whitespace=True, max_total_tokens=384,
        schedule_conservativeness=0.0))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_json_schema_response_format(client):
    for temperature in (0.0, 1.0):
        out = client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=96, temperature=temperature,
            seed=3, response_format={"type": "json_schema",
                                     "json_schema": {"name": "person", "schema": SCHEMA}})
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        assert matches(json.loads(choice.message.content), SCHEMA), choice.message.content


def test_streamed_json_schema(client):
    """Streamed, the pieces join into the same kind of document, and the stream ends with
    finish_reason "stop" once the grammar is complete."""
    chunks = list(client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=96, temperature=1.0, seed=7,
        stream=True, response_format={"type": "json_schema",
                                      "json_schema": {"name": "person", "schema": SCHEMA}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == ["stop"], finishes
    assert matches(json.loads(text), SCHEMA), text


def test_json_schema_on_completions_and_generate(client, server):
    out = client.completions.create(model="default", prompt="Person:", max_tokens=96,
                                    temperature=1.0, seed=5, n=2,
                                    extra_body={"json_schema": json.dumps(SCHEMA)})
    for choice in out.choices:
        assert matches(json.loads(choice.text), SCHEMA), choice.text
    r = requests.post(server.url + "/generate", json={
        "text": "Person:", "sampling_params": {"max_new_tokens": 96, "temperature": 0,
                                               "json_schema": json.dumps(SCHEMA)}}, timeout=60)
    assert r.status_code == 200, r.text
    assert matches(json.loads(r.json()["text"]), SCHEMA)


def test_regex_and_ebnf(client):
    pattern = r"(yes|no), [0-9]{2,4}!"
    for temperature in (0.0, 1.0):
        out = client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=32, temperature=temperature,
            seed=7, extra_body={"regex": pattern})
        assert re.fullmatch(pattern, out.choices[0].message.content), out.choices[0]
        assert out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model="default", prompt="Answer:", max_tokens=16, temperature=1.0, seed=1,
        extra_body={"ebnf": 'root ::= "ans=" digit digit\ndigit ::= [0-9]'})
    assert re.fullmatch(r"ans=[0-9]{2}", out.choices[0].text), out.choices[0].text


def test_top_logprobs_leave_out_forbidden_ids(client):
    out = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"regex": "(ok|no)"})
    assert out.choices[0].message.content in ("ok", "no")
    for entry in out.choices[0].logprobs.content:
        assert 1 <= len(entry.top_logprobs) <= 3
        assert all(t.logprob is not None and t.logprob <= 0 for t in entry.top_logprobs)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the top one


def test_json_object(client):
    out = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":  # complete: one JSON object
        assert isinstance(json.loads(text), dict), text


def test_tool_choice_required_and_named(client):
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice="required", max_tokens=64, temperature=1.0, seed=2)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    assert matches(json.loads(call.function.arguments), tool["function"]["parameters"])
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=64,
        temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    assert out.choices[0].finish_reason == "tool_calls"


def test_retraction_replays_the_matcher(server):
    """Eight constrained requests that outgrow the KV cache together: some are retracted
    and resume with a rebuilt matcher (replaying their tokens); every output still matches."""
    pattern = r"(ab|cd|ef){30,40}\."
    before = server.get("/get_server_info").json()["num_retractions"]
    r = requests.post(server.url + "/generate", json={
        "input_ids": [[5 + i, 6, 7, 8] * 10 for i in range(8)],
        "sampling_params": [{"max_new_tokens": 64, "temperature": 1.0, "seed": i,
                             "regex": pattern} for i in range(8)]}, timeout=120)
    assert r.status_code == 200, r.text
    assert server.get("/get_server_info").json()["num_retractions"] > before
    for out in r.json():
        text, reason = out["text"], out["meta_info"]["finish_reason"]["type"]
        if reason == "stop":
            assert re.fullmatch(pattern, text), text
        else:  # cut at 64 tokens: a prefix of a match
            assert reason == "length" and re.fullmatch(r"((ab|cd|ef)*)(a|c|e)?", text), text


@pytest.mark.parametrize("body, words", [
    ({"regex": "a(b"}, ["regex", "unclosed group"]),
    ({"json_schema": '{"type": "foo"}'}, ["json_schema", "foo"]),
    ({"json_schema": "{not json"}, ["json_schema", "not valid JSON"]),
    ({"ebnf": "root ::= ("}, ["ebnf"]),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, ["at most one"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ["nope"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     ["response_format does not compile", "foo"]),
    ({"response_format": {"type": "json_schema"}}, ["json_schema.schema"]),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, ["at most one"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, ["tool_choice does not compile", "foo"]),
])
def test_bad_grammar_is_400_and_server_serves(client, body, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    message = str(err.value)
    assert all(w in message for w in words), message
    out = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                         extra_body={"regex": "ok"})
    assert out.choices[0].message.content == "ok"


def test_apply_vocab_mask_matches_numpy():
    rng = np.random.default_rng(0)
    batch, vocab = 5, 100  # 4 words; the last one's bits past id 99 are padding
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(batch, 4), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # a row without a grammar: every id allowed
    allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    want = np.where(allowed.astype(bool), logits, -np.inf)
    got = np.asarray(apply_vocab_mask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[0]).all()


def test_matchers_live_in_state_slots_and_replay_after_release():
    """A matcher is dropped with its slot; a retracted request's new matcher replays its
    tokens and gives the same mask (checked against the first matcher's mask)."""
    from types import SimpleNamespace

    from sgl_jax.srt.constrained.grammar import GrammarCompiler, llg_tokenizer
    from sgl_jax.srt.constrained.matchers import GRAMMAR_MATCHERS, GrammarMatchers
    from sgl_jax.srt.mem_cache.request_state import RequestStateTable
    from sgl_jax.srt.tokenizer import Tokenizer
    from sgl_jax.testing import ensure_test_model

    tok = Tokenizer.from_pretrained(ensure_test_model())
    lt = llg_tokenizer(tok, len(tok) + 40, tok.eos_token_ids)  # a padded model vocabulary
    grammar = GrammarCompiler(lt).compile("regex", "(cat|dog)s?!")
    states = RequestStateTable(4)
    matchers = GrammarMatchers(lt, states)
    req = SimpleNamespace(grammar=grammar, grammar_build=None, state_slot=states.alloc(),
                          output_ids=[])
    matchers.prepare(req)
    first = matchers.mask([req], [True])
    allowed = np.flatnonzero(np.unpackbits(first[0].view(np.uint8), bitorder="little"))
    assert {tok.decode([int(i)]) for i in allowed} <= {"c", "ca", "cat", "d", "do", "dog",
                                                        "cats", "dogs"}
    assert allowed.max() < len(tok)  # the padding ids are never allowed
    for t in tok.encode("dog", add_special_tokens=False):
        req.output_ids.append(t)
        assert matchers.advance(req, t) == (None, False)
    before = matchers.mask([req], [True])
    states.free(req.state_slot)
    assert states.rows(GRAMMAR_MATCHERS)[req.state_slot] is None
    req.state_slot = states.alloc()
    np.testing.assert_array_equal(matchers.mask([req], [True]), before)
    error, _ = matchers.advance(req, tok.encode("x", add_special_tokens=False)[0])
    assert error is not None and "refused" in error
    matchers.close()


def test_streamed_required_tool_call(client):
    chunks = [c for c in client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=1.0, seed=4, stream=True) if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in calls)
    assert matches(json.loads(arguments), TOOLS[0]["function"]["parameters"])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_constraints_refused_by_name_without_a_backend_or_with_speculation():
    from sgl_jax.srt.constrained.grammar import GrammarCompiler, llg_tokenizer, request_grammar
    from sgl_jax.srt.tokenizer import Tokenizer
    from sgl_jax.testing import ensure_test_model

    tok = Tokenizer.from_pretrained(ensure_test_model())
    compiler = GrammarCompiler(llg_tokenizer(tok, len(tok), tok.eos_token_ids))
    assert request_grammar(compiler, None, "EAGLE") is None
    with pytest.raises(ValueError, match="regex.*--grammar-backend none"):
        request_grammar(None, ("regex", "a"), None)
    with pytest.raises(ValueError, match="json_schema.*--speculative-algorithm NGRAM"):
        request_grammar(compiler, ("json_schema", "{}"), "NGRAM")
    with pytest.raises(ValueError, match="at most 65536"):
        compiler.compile("regex", "a" * 70_000)
    assert compiler.compile("regex", "ab") is compiler.compile("regex", "ab")  # cached
    from sgl_jax.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="grammar_backend='xgrammar'; use one of llguidance"):
        ServerArgs(grammar_backend="xgrammar")


def test_sampling_params_constraint_fields():
    from sgl_jax.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"json_schema": {"type": "integer"}})
    params.verify(512)
    assert params.constraint() == ("json_schema", '{"type": "integer"}')
    assert SamplingParams().constraint() is None
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'}).verify(512)
    with pytest.raises(ValueError, match="regex must be a string"):
        SamplingParams.from_dict({"regex": 3})


# The tool-call grammars of every parser, unit-tested: tests/test_tool_grammars.py.
