"""The OpenAI-compatible routes driven by the official ``openai`` client, routed experts included.

The server serves the bundled tiny model under the name Qwen/Qwen3-30B-A3B. Routed-experts rows
returned over HTTP must equal an independent float64 reference forward teacher-forced with the
prompt ids (tokenized as the server does) and the output ids (recovered from ``/generate`` with
the same prompt ids and sampling parameters, whose text must match the OpenAI response's).
"""

from __future__ import annotations

import numpy as np
import openai
import pybase64
import pytest
import requests

from sgl_jax.srt.routed_experts_codec import (
    extract_prompt_routed_expert_weights_from_meta_info,
    extract_prompt_routed_experts_from_meta_info,
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.testing import server_flags
from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows
from tests.server_utils import server_fixture

MODEL = "Qwen/Qwen3-30B-A3B"
ROUTED = {"return_routed_experts": True}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Explain "},
                                         {"type": "text", "text": "MoE models"}]}]


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(
        request, server_flags(enable_return_routed_experts=True, served_model_name=MODEL,
                              enable_return_routed_expert_weights=True))


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


def decode_rows(meta: dict, info: dict) -> np.ndarray:
    raw = pybase64.b64decode(meta["routed_experts"].encode("utf-8"))
    flat = np.frombuffer(raw, dtype=np.int32)
    return flat.reshape(-1, info["num_hidden_layers"], info["num_experts_per_tok"])


def joined_meta(choices: list) -> dict:
    """The final ``meta_info`` of a streamed choice (its chunks' choices, ``openai`` objects)
    with the routed-experts rows of every chunk joined: each chunk carries the rows completed
    since the previous one, starting at ``routed_experts_start``, none twice."""
    parts, pos = [], 0
    for c in choices:
        meta = getattr(c, "meta_info", None)
        if meta is None or "routed_experts" not in meta:
            continue
        assert meta["routed_experts_start"] == pos
        part = extract_routed_experts_from_meta_info(c)
        assert list(part.shape) == meta["routed_experts_shape"]
        pos += part.shape[0]
        parts.append(part)
    final = dict(choices[-1].meta_info)
    rows = np.concatenate(parts).astype("<i4")
    final["routed_experts"] = pybase64.b64encode(rows.tobytes()).decode()
    return final


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def replay(server, prompt_ids: list[int], params: dict) -> dict:
    """The same request through /generate: gives the output ids the OpenAI routes do not."""
    res = server.post("/generate", json={"input_ids": prompt_ids, "sampling_params": params})
    assert res.status_code == 200, res.text
    return res.json()


def check_rows(server, reference, info, meta: dict, text: str, prompt_ids: list[int],
               params: dict) -> None:
    rows = decode_rows(meta, info)
    assert meta["prompt_tokens"] == len(prompt_ids)
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1
    again = replay(server, prompt_ids, params)
    assert again["text"] == text
    assert len(again["output_ids"]) == meta["completion_tokens"]
    np.testing.assert_array_equal(rows, routed_experts_rows(reference, prompt_ids,
                                                            again["output_ids"]))


# -- completions --------------------------------------------------------------------------------
def test_completion_routed_experts_match_reference(server, client, info, tokenizer, reference):
    prompt = "Routing replay needs the expert ids"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body=ROUTED)
    choice = out.choices[0]
    assert out.model == MODEL and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == choice.meta_info["prompt_tokens"]
    assert out.usage.completion_tokens == choice.meta_info["completion_tokens"]
    check_rows(server, reference, info, choice.meta_info, choice.text, tokenizer.encode(prompt),
               {"max_new_tokens": 8, "temperature": 0})


def test_completion_stream_with_usage(server, client, info, tokenizer, reference):
    prompt = "A streamed completion"
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=ROUTED))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens > 0
    # Before the usage chunk: the sglext chunk (no choices, the whole rows; test_openai_sglext).
    assert chunks[-2].choices == [] and chunks[-2].sglext["routed_experts"]
    body = chunks[:-2]
    # Chunks before the last carry only the routed-experts keys of their new rows.
    assert all(set(c.choices[0].meta_info) == {
        "routed_experts", "routed_experts_start", "routed_experts_dtype", "routed_experts_shape"}
        for c in body[:-1])
    final = body[-1].choices[0]
    assert final.finish_reason in ("stop", "length")
    text = "".join(c.choices[0].text for c in body)
    assert usage.usage.prompt_tokens == final.meta_info["prompt_tokens"]
    check_rows(server, reference, info, joined_meta([c.choices[0] for c in body]), text,
               tokenizer.encode(prompt), {"max_new_tokens": 7, "temperature": 0})


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_rows_in_a_narrow_dtype_equal_the_whole(server, client, info, route):
    """Both OpenAI routes: streamed chunks of uint8 rows (and their float16 routing weights)
    concatenate to the non-streamed ones."""
    extra = {**ROUTED, "routed_experts_dtype": "uint8", "routed_experts_start_len": 2,
             "return_routed_expert_weights": True, "routed_expert_weights_dtype": "float16"}
    if route == "chat":
        create = client.chat.completions.create
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                      extra_body=extra)
    else:
        create = client.completions.create
        kwargs = dict(model=MODEL, prompt="Rows in chunks", max_tokens=6, temperature=0,
                      extra_body=extra)
    whole = create(**kwargs).choices[0]
    rows = extract_routed_experts_from_meta_info(whole)
    assert rows.dtype == np.uint8 and whole.meta_info["routed_experts_dtype"] == "uint8"
    assert whole.meta_info["routed_experts_start"] == 2
    chunks = [c.choices[0] for c in create(stream=True, **kwargs) if c.choices]
    assert all(getattr(c, "meta_info", None) for c in chunks)  # every chunk brings rows
    parts = [extract_routed_experts_from_meta_info(c) for c in chunks]
    assert [c.meta_info["routed_experts_start"] for c in chunks] == list(
        2 + np.cumsum([0] + [p.shape[0] for p in parts[:-1]]))
    np.testing.assert_array_equal(np.concatenate(parts), rows)
    weights = extract_routed_expert_weights_from_meta_info(whole)
    assert weights.dtype == np.float16 and weights.shape == rows.shape
    np.testing.assert_array_equal(
        np.concatenate([extract_routed_expert_weights_from_meta_info(c) for c in chunks]),
        weights)


def test_completion_token_prompts_and_model_path(server, client, info):
    out = client.completions.create(model=info["model_path"], prompt=[[3, 4, 5], [6, 7]],
                                    max_tokens=2, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 5
    assert all("routed_experts" not in c.meta_info for c in out.choices)


# -- chat ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_chat_routed_experts_match_reference(server, client, info, tokenizer, reference, stream):
    params = {"max_new_tokens": 9, "temperature": 0}
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0, extra_body=ROUTED)
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices]  # not the sglext chunk
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        meta = joined_meta([c.choices[0] for c in chunks])
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    else:
        out = client.chat.completions.create(**kwargs)
        assert out.choices[0].message.role == "assistant"
        text, meta = out.choices[0].message.content, out.choices[0].meta_info
        assert out.usage.total_tokens == meta["prompt_tokens"] + meta["completion_tokens"]
    check_rows(server, reference, info, meta, text, chat_prompt_ids(tokenizer, MESSAGES), params)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_chat_n2_with_seed_gives_two_complete_choices(server, client, info, tokenizer, reference,
                                                       stream):
    seed, ids = 1234, chat_prompt_ids(tokenizer, MESSAGES)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=seed, n=2,
                  extra_body=ROUTED)
    if stream:
        texts, parts = {0: "", 1: ""}, {0: [], 1: []}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                parts[c.index].append(c)
        choices = [(texts[i], joined_meta(parts[i])) for i in (0, 1)]
    else:
        out = client.chat.completions.create(**kwargs)
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.prompt_tokens == len(ids)  # the prompt is counted once
        choices = [(c.message.content, c.meta_info) for c in out.choices]
    assert choices[0][1]["id"] != choices[1][1]["id"]
    for i, (text, meta) in enumerate(choices):
        params = {"max_new_tokens": 6, "temperature": 1.0, "seed": seed + i}
        check_rows(server, reference, info, meta, text, ids, params)


def test_extract_takes_the_openai_clients_objects(server, client, info, tokenizer, reference):
    """extract_routed_experts_from_meta_info takes the client's response, choice and stream
    chunk as they come (no model_dump()), and gives the same rows as the raw meta_info."""
    shape = (-1, info["num_hidden_layers"], info["num_experts_per_tok"])
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, extra_body=ROUTED)
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    want = decode_rows(choice.meta_info, info)
    for data in (out, choice, choice.model_dump(), out.model_dump(), choice.meta_info):
        np.testing.assert_array_equal(extract_routed_experts_from_meta_info(data).reshape(shape),
                                      want)
    check_rows(server, reference, info, choice.meta_info, choice.message.content,
               chat_prompt_ids(tokenizer, MESSAGES), {"max_new_tokens": 5, "temperature": 0})
    last = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices][-1]
    start = last.choices[0].meta_info["routed_experts_start"]
    np.testing.assert_array_equal(extract_routed_experts_from_meta_info(last).reshape(shape),
                                  want[start:])
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=2,
                                           extra_body=ROUTED)
    assert extract_routed_experts_from_meta_info(completion).reshape(shape).shape[0] == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens - 1)
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert extract_routed_experts_from_meta_info(plain) is None
    two = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, n=2,
                                    extra_body=ROUTED)
    with pytest.raises(ValueError, match="2 choices"):
        extract_routed_experts_from_meta_info(two)
    assert extract_routed_experts_from_meta_info(two.choices[1]) is not None


def extend_tokens(server) -> int:
    return server.get("/get_server_info").json()["step_stats"]["extend"]["tokens"]


def split_rows(choices: list) -> tuple[np.ndarray | None, np.ndarray]:
    """(prompt rows, generated rows) of a ``routed_experts_split`` choice, from its one
    response choice or its stream chunks' choices, each run checked to follow the previous."""
    prompt, gen, positions = [], [], {"prompt_": None, "": None}
    for c in choices:
        meta = getattr(c, "meta_info", None) or {}
        for prefix, parts, extract in (
            ("prompt_", prompt, extract_prompt_routed_experts_from_meta_info),
            ("", gen, extract_routed_experts_from_meta_info),
        ):
            if f"{prefix}routed_experts" not in meta:
                continue
            start = meta[f"{prefix}routed_experts_start"]
            assert positions[prefix] in (None, start)
            part = extract(c)
            positions[prefix] = start + part.shape[0]
            parts.append(part)
    return (np.concatenate(prompt) if prompt else None), np.concatenate(gen)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_n_choices_share_one_prefill_and_split_rows(server, client, info, reference, stream):
    """n = 4 copies of one prompt: it is prefilled once (each choice computes only its last
    prompt token, the rest is a prefix-cache hit), and with routed_experts_split the prompt's
    rows come once, in choice 0, apart from each choice's generated rows; all equal the
    reference."""
    rng = np.random.default_rng(99 + stream)
    prompt = rng.integers(0, info["vocab_size"], 200).tolist()
    n, seed, max_new = 4, 77, 5
    before = extend_tokens(server)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_new, temperature=1.0, seed=seed,
                  n=n, extra_body={**ROUTED, "routed_experts_split": True})
    if stream:
        parts: dict[int, list] = {i: [] for i in range(n)}
        texts = dict.fromkeys(range(n), "")
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                parts[c.index].append(c)
                texts[c.index] += c.text
        choices = [(texts[i], parts[i]) for i in range(n)]
    else:
        out = client.completions.create(**kwargs)
        choices = [(c.text, [c]) for c in out.choices]
    assert extend_tokens(server) - before == len(prompt) + n  # one prefill, then 1 token each
    page = server.get("/get_server_info").json()["server_args"]["page_size"]
    for i, (text, pieces) in enumerate(choices):
        meta = pieces[-1].meta_info
        assert meta["cached_tokens"] == (len(prompt) - 1) // page * page
        again = replay(server, prompt, {"max_new_tokens": max_new, "temperature": 1.0,
                                        "seed": seed + i})
        assert again["text"] == text
        want = routed_experts_rows(reference, prompt, again["output_ids"])
        prompt_rows, gen_rows = split_rows(pieces)
        if i == 0:
            np.testing.assert_array_equal(prompt_rows, want[: len(prompt)])
        else:
            assert prompt_rows is None  # sent once, not n times
        np.testing.assert_array_equal(gen_rows, want[len(prompt):])
        assert meta["routed_experts_start"] + meta["routed_experts_shape"][0] == len(want)


def test_generate_batch_of_one_prompt_prefills_it_once(server, info, reference):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, info["vocab_size"], 120).tolist()
    before = extend_tokens(server)
    res = server.post("/generate", json={
        "input_ids": [prompt] * 3, "sampling_params": {"max_new_tokens": 3},
        "return_routed_experts": True, "return_routed_expert_weights": True,
        "routed_experts_split": [True, False, True],
    })
    assert res.status_code == 200, res.text
    assert extend_tokens(server) - before == len(prompt) + 3
    first, plain, third = res.json()
    want = [routed_experts_rows(reference, prompt, r["output_ids"]) for r in res.json()]
    np.testing.assert_array_equal(extract_prompt_routed_experts_from_meta_info(first),
                                  want[0][: len(prompt)])
    assert extract_prompt_routed_expert_weights_from_meta_info(first).shape == (
        len(prompt), info["num_hidden_layers"], info["num_experts_per_tok"])
    np.testing.assert_array_equal(extract_routed_experts_from_meta_info(first),
                                  want[0][len(prompt):])
    np.testing.assert_array_equal(extract_routed_experts_from_meta_info(plain), want[1])
    assert extract_prompt_routed_experts_from_meta_info(third) is None  # sent once
    np.testing.assert_array_equal(extract_routed_experts_from_meta_info(third),
                                  want[2][len(prompt):])


@pytest.mark.parametrize("messages,status", [
    ([{"role": "user"}], 400),
    ([{"role": "user", "content": None}], 400),
    ([{"role": "system"}, {"role": "user", "content": "hi"}], 400),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], 400),
    ([{"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
          "name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "4"}], 200),
], ids=["user-no-content", "user-null-content", "system-no-content", "assistant-no-content",
        "assistant-tool-calls-no-content"])
def test_chat_message_content_is_required_as_with_openai(server, messages, status):
    res = server.post("/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert res.status_code == status, res.text
    if status == 400:
        error = res.json()["error"]
        assert error["type"] == "invalid_request_error" and "content" in error["message"]
        assert error["param"] == "messages"


def test_user_story_program(server, info):
    num_layers, num_experts_per_tok = info["num_hidden_layers"], info["num_experts_per_tok"]
    response = requests.post(f"{server.url}/v1/chat/completions", json={
        "model": "Qwen/Qwen3-30B-A3B", "messages": [{"role": "user", "content": "Explain MoE models"}],
        "return_routed_experts": True, "max_tokens": 50}).json()
    routed_experts_b64 = response["choices"][0]["meta_info"]["routed_experts"]
    expert_ids = np.frombuffer(pybase64.b64decode(routed_experts_b64.encode("utf-8")), dtype=np.int32)
    expert_ids = expert_ids.reshape(-1, num_layers, num_experts_per_tok)

    usage = response["usage"]
    assert expert_ids.shape[0] == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert ((expert_ids >= 0) & (expert_ids < info["num_experts"])).all()


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


# -- errors -------------------------------------------------------------------------------------
OPENAI_ERRORS = [
    ("unknown-model", openai.NotFoundError, dict(model="gpt-4")),
    ("top-logprobs-too-many", openai.BadRequestError, dict(logprobs=True, top_logprobs=21)),
    ("top-logprobs", openai.BadRequestError, dict(top_logprobs=2)),
    ("negative-temperature", openai.BadRequestError, dict(temperature=-1.0)),
    ("top-p-zero", openai.BadRequestError, dict(top_p=0.0)),
    ("too-many-tokens", openai.BadRequestError, dict(max_tokens=10**6)),
    ("n-too-large", openai.BadRequestError, dict(n=10**4)),
    ("start-len-out-of-range", openai.BadRequestError,
     dict(extra_body={"return_routed_experts": True, "routed_experts_start_len": 10**4})),
    ("start-len-wrong-type", openai.BadRequestError,
     dict(extra_body={"return_routed_experts": True, "routed_experts_start_len": "3"})),
    ("routed-experts-wrong-type", openai.BadRequestError,
     dict(extra_body={"return_routed_experts": "yes"})),
    ("penalty-unsupported", openai.BadRequestError, dict(frequency_penalty=0.5)),
]


@pytest.mark.parametrize("error,kwargs", [c[1:] for c in OPENAI_ERRORS],
                         ids=[c[0] for c in OPENAI_ERRORS])
def test_chat_errors(server, client, error, kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as caught:
        client.chat.completions.create(**kwargs)
    body = caught.value.body
    assert isinstance(body, dict) and body["message"] and "type" in body
    assert server.get("/health_generate").status_code == 200


def test_stream_errors_are_http_errors(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=2, stream=True)
    assert server.get("/health_generate").status_code == 200
