"""SGLang's OpenAI habits through real HTTP and the official ``openai`` client: the "default"
model name, the top-level ``sglext``, token-in/token-out chat (a multi-turn episode whose
per-turn rows join into one full-context request's rows), ``return_token_ids`` and tools.

The server runs the bundled tiny model without ``--served-model-name``. Rows are checked
against the independent float64 reference forward (``routed_experts_rows``), teacher-forced
with the ids the server reports.
"""

from __future__ import annotations

import os

import numpy as np
import openai
import pybase64
import pytest
import requests

from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.testing import server_flags
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows
from tests.server_utils import server_fixture, sse_events

MESSAGES = [{"role": "user", "content": "Explain MoE models"}]
ROUTED = {"return_routed_experts": True}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags(enable_return_routed_experts=True))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def info(server):
    return server.get("/get_model_info").json()


@pytest.fixture(scope="module")
def tokenizer(info):
    return Tokenizer.from_pretrained(info["model_path"])


@pytest.fixture(scope="module")
def reference(info):
    return ReferenceModel(info["model_path"])


def int32_rows(b64: str, info: dict) -> np.ndarray:
    flat = np.frombuffer(pybase64.b64decode(b64), dtype="<i4")
    return flat.reshape(-1, info["num_hidden_layers"], info["num_experts_per_tok"])


def chat_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# -- 1. model names -----------------------------------------------------------------------------
def test_default_reaches_the_served_model_named_after_its_directory(server, client, info):
    served = info["served_model_name"]
    assert served == os.path.basename(os.path.normpath(info["model_path"]))
    assert [m.id for m in client.models.list().data] == [served]
    out = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2)
    assert out.model == served and out.choices[0].finish_reason in ("stop", "length")
    out = client.completions.create(model="default", prompt="abc", max_tokens=2)
    assert out.model == served
    res = server.post("/generate", json={"model": "default", "text": "abc",
                                         "sampling_params": {"max_new_tokens": 1}})
    assert res.status_code == 200, res.text


def test_unknown_model_404_names_what_is_served_and_no_path(server, client, info):
    for create in (lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES),
                   lambda: client.completions.create(model="gpt-4", prompt="x")):
        with pytest.raises(openai.NotFoundError) as caught:
            create()
        message = caught.value.body["message"]
        assert repr(info["served_model_name"]) in message and "'default'" in message
        assert info["model_path"] not in message and os.sep + "tmp" not in message


# -- 2. sglext -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_chat_sglext_rows_and_ids_match_reference(server, client, info, tokenizer, reference,
                                                   stream):
    extra = {**ROUTED, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True,
             "return_cached_tokens_details": True, "routed_experts_dtype": "uint8"}
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=7, temperature=0,
                  extra_body=extra)
    prompt = chat_ids(tokenizer, MESSAGES)
    if stream:
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))
        *body, ext_chunk, usage_chunk = chunks
        assert all(getattr(c, "sglext", None) is None for c in body)
        assert body[-1].choices[0].finish_reason in ("stop", "length")
        assert ext_chunk.choices == [] and ext_chunk.usage is None
        assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens > 0
        ext = ext_chunk.sglext
        text = "".join(c.choices[0].delta.content or "" for c in body)
        meta_rows = np.concatenate([extract_routed_experts_from_meta_info(c.choices[0])
                                    for c in body if c.choices[0].meta_info])
        cached = body[-1].choices[0].meta_info["cached_tokens"]
    else:
        out = client.chat.completions.create(**kwargs)
        ext = out.sglext
        text = out.choices[0].message.content
        meta_rows = extract_routed_experts_from_meta_info(out.choices[0])
        cached = out.choices[0].meta_info["cached_tokens"]
    assert ext["input_ids"] == prompt
    output_ids = ext["output_ids"]
    assert tokenizer.decode(output_ids, skip_special_tokens=True) == text
    rows = int32_rows(ext["routed_experts"], info)
    want = routed_experts_rows(reference, prompt, output_ids)
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(meta_rows.astype(np.int32), want)  # uint8 ids < 255
    assert ext["cached_tokens_details"] == {"device": cached, "host": 0}
    assert "spec_tokens_details" not in ext  # no speculation on this server


def test_sglext_chunk_order_on_the_wire(server):
    """After the finish chunk: one chunk of no choices with the whole sglext, the usage chunk,
    then [DONE]; nothing asked, no sglext anywhere."""
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "return_output_ids_in_sglext": True}
    events = sse_events(requests.post(server.url + "/v1/chat/completions", json=body,
                                      stream=True, timeout=60))
    assert events[-1] == "[DONE]"
    ext, usage = events[-3], events[-2]
    assert ext["choices"] == [] and "usage" not in ext and set(ext["sglext"]) == {"output_ids"}
    assert usage["choices"] == [] and "sglext" not in usage
    assert events[-4]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("sglext" not in e for e in events[:-3])
    plain = sse_events(requests.post(server.url + "/v1/chat/completions", json={
        **body, "return_output_ids_in_sglext": False}, stream=True, timeout=60))
    assert all("sglext" not in e for e in plain[:-1])
    whole = requests.post(server.url + "/v1/chat/completions", json={
        "model": "default", "messages": MESSAGES, "max_tokens": 2}, timeout=60).json()
    assert "sglext" not in whole


def test_sglext_ids_by_headers(client, tokenizer):
    out = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=3, temperature=0,
        extra_headers={"x-sglext-return-input-ids": "true", "x-sglext-return-output-ids": "1"})
    assert out.sglext["input_ids"] == chat_ids(tokenizer, MESSAGES)
    assert len(out.sglext["output_ids"]) == out.usage.completion_tokens
    assert "routed_experts" not in out.sglext


def test_completion_sglext_and_token_ids(server, client, info, tokenizer, reference):
    prompt = "Routing replay needs the expert ids"
    kwargs = dict(model="default", prompt=prompt, max_tokens=6, temperature=0,
                  extra_body={**ROUTED, "return_token_ids": True})
    out = client.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode(prompt)
    assert len(choice.token_ids) == out.usage.completion_tokens
    np.testing.assert_array_equal(
        int32_rows(out.sglext["routed_experts"], info),
        routed_experts_rows(reference, choice.prompt_token_ids, choice.token_ids))
    chunks = list(client.completions.create(stream=True, **kwargs))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].prompt_token_ids == choice.prompt_token_ids
    assert all(getattr(p, "prompt_token_ids", None) is None for p in pieces[1:])
    assert sum((p.token_ids for p in pieces), []) == choice.token_ids
    assert chunks[-1].choices == [] and chunks[-1].sglext["routed_experts"] == \
        out.sglext["routed_experts"]


def test_n2_keeps_rows_in_meta_info_and_omits_sglext(client):
    out = client.completions.create(model="default", prompt="abc", max_tokens=2, n=2,
                                    extra_body=ROUTED)
    assert getattr(out, "sglext", None) is None
    assert all(extract_routed_experts_from_meta_info(c) is not None for c in out.choices)


# -- 3. token in / token out, the multi-turn Target ---------------------------------------------
def rl_turn(client, input_ids: list[int], start_len: int, max_tokens: int) -> tuple:
    """One turn as SGLang-based RL frameworks send it; (output ids, rows, sglext)."""
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "(token ids given)"}],
        max_tokens=max_tokens, temperature=0, logprobs=True,
        extra_body={"input_ids": input_ids, "return_meta_info": True, **ROUTED,
                    "routed_experts_start_len": start_len,
                    "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True})
    choice = out.choices[0]
    meta = choice.meta_info
    assert "routed_experts" not in out.sglext  # with return_meta_info: in meta_info only
    assert out.sglext["input_ids"] == input_ids  # the prompt exactly: no template
    assert meta["prompt_tokens"] == len(input_ids) == out.usage.prompt_tokens
    output_ids = [entry[1] for entry in meta["output_token_logprobs"]]
    assert output_ids == out.sglext["output_ids"]
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
        [entry[0] for entry in meta["output_token_logprobs"]])
    assert meta["routed_experts_start"] == start_len
    return output_ids, extract_routed_experts_from_meta_info(choice).astype(np.int32)


def test_multi_turn_rows_join_into_the_full_context_rows(client, info, tokenizer, reference):
    turn_tail = tokenizer.encode("\nuser: and the router?\nassistant:", add_special_tokens=False)
    context, start, parts = chat_ids(tokenizer, MESSAGES), 0, []
    for turn, max_tokens in enumerate((5, 4, 6)):
        if turn:
            context = context + turn_tail  # the next user message's tokens
        output_ids, rows = rl_turn(client, context, start, max_tokens)
        assert rows.shape[0] == len(context) + len(output_ids) - 1 - start
        parts.append(rows)
        context = context + output_ids
        start = len(context) - 1  # the next turn's routed_experts_start_len
    joined = np.concatenate(parts)
    assert joined.shape[0] == len(context) - 1
    # One request over the whole episode: its prompt is all but the last token, which it
    # generates (the rows of a sequence stop one short of its end).
    full = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=1, temperature=0,
        extra_body={"input_ids": context[:-1], **ROUTED})
    full_rows = extract_routed_experts_from_meta_info(full.choices[0]).astype(np.int32)
    np.testing.assert_array_equal(joined, full_rows)
    np.testing.assert_array_equal(joined, routed_experts_rows(reference, context[:-1],
                                                              context[-1:]))


# -- 4. tools ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tools_auto_and_none_are_accepted(client, stream):
    """The bundled model's template ignores tools and its random weights never write a
    call: "auto" then gives the text as content, unchanged (the parsing itself is tested
    on the parsers, tests/test_tool_parsers.py)."""
    for choice in ("auto", "none"):
        kwargs = dict(model="default", messages=MESSAGES, max_tokens=4, tools=TOOLS,
                      tool_choice=choice, temperature=0)
        want = client.chat.completions.create(model="default", messages=MESSAGES,
                                              max_tokens=4, temperature=0)
        if stream:
            chunks = [c for c in client.chat.completions.create(stream=True, **kwargs)
                      if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert all(c.choices[0].delta.tool_calls is None for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.chat.completions.create(**kwargs)
            text, reason = out.choices[0].message.content, out.choices[0].finish_reason
            assert out.choices[0].message.tool_calls is None
        assert text == want.choices[0].message.content
        assert reason == want.choices[0].finish_reason


def test_docs_example_runs(server, info, reference):
    """docs/examples/openai_agentic_turns.py as written: its joined rows are the episode's."""
    import runpy

    example = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "docs", "examples",
                                          "openai_agentic_turns.py"))
    got = example["main"](server.url)
    episode = got["episode"]
    np.testing.assert_array_equal(got["rows"], routed_experts_rows(reference, episode[:-1],
                                                                   episode[-1:]))


@pytest.fixture(scope="module")
def spec_server(request):
    from sgl_jax.testing import TEST_MODEL_PATH

    yield from server_fixture(request, server_flags(
        model_path=TEST_MODEL_PATH, speculative_algorithm="NGRAM", speculative_num_steps=3,
        enable_return_routed_experts=True))


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_spec_tokens_details_with_speculation(spec_server, stream):
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    kwargs = dict(model="default", prompt=[5, 6, 7, 8] * 6, max_tokens=12, temperature=0,
                  extra_body={**ROUTED, "ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        ext, meta = chunks[-1].sglext, chunks[-2].choices[0].meta_info
        assert chunks[-1].choices == []
    else:
        out = client.completions.create(**kwargs)
        ext, meta = out.sglext, out.choices[0].meta_info
    verify_ct = meta["spec_verify_ct"]
    assert ext["spec_tokens_details"] == {
        "spec_verify_ct": verify_ct, "spec_accept_length": pytest.approx(12 / verify_ct)}
    info = spec_server.get("/get_model_info").json()
    rows = int32_rows(ext["routed_experts"], info)
    assert rows.shape[0] == 24 + 12 - 1  # the whole sequence's rows, int32
