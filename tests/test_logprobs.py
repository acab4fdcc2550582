"""Logprobs (M10 item 1): computed in the jitted step, checked against the float64 reference.

The reference forward of prompt + output ids gives float64 logits at every position; the
distribution is ``log_softmax(logits / T)`` (T = 1 for greedy). Every returned logprob must be
within 1e-5 of it, the sampled token's included, and the top-k ids equal the reference's
order. Input (prompt) logprobs start at ``logprob_start_len`` and are computed, not cached.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

from sgl_jax import Engine
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags
from sgl_jax.tools.reference_forward import ReferenceModel
from tests.server_utils import server_fixture

# Float32 engine against the float64 reference: 1e-5 absolute, plus a relative 4e-6 (about
# 32 float32 epsilons) for large logprobs divided by a temperature below 1; XLA's CPU code for
# the same program rounds differently on different processors (2.9e-6 relative seen at -4.3
# with temperature 0.7).
TOL, RTOL = 1e-5, 4e-6
PROMPT = [7, 300, 12, 45, 45, 99, 1, 250, 31, 8, 77, 410]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(**engine_args(enable_return_routed_experts=True))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    return ReferenceModel(TEST_MODEL_PATH)


def ref_logprobs(reference, ids: list[int], temperature: float) -> np.ndarray:
    """[len(ids), V] float64: row p is the distribution of the token after position p."""
    logits = reference.forward(ids).logits / (temperature if temperature > 0 else 1.0)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def check_positions(lp: np.ndarray, tokens: list, tops: list | None, ids_lp: list | None,
                    targets: list[int], rows: range, token_ids: list[int] | None) -> None:
    assert len(tokens) == len(rows)
    for j, row in enumerate(rows):
        logprob, token, text = tokens[j]
        assert token == targets[j] and text is None
        assert abs(logprob - lp[row, token]) < TOL + RTOL * abs(lp[row, token]), (
            row, logprob, lp[row, token])
        if tops is not None:
            want = np.argsort(-lp[row], kind="stable")[: len(tops[j])]
            assert [t for _, t, _ in tops[j]] == want.tolist()
            np.testing.assert_allclose([v for v, _, _ in tops[j]], lp[row, want], atol=TOL,
                                       rtol=RTOL)
        if token_ids is not None:
            assert [t for _, t, _ in ids_lp[j]] == token_ids
            np.testing.assert_allclose([v for v, _, _ in ids_lp[j]], lp[row, token_ids],
                                       atol=TOL, rtol=RTOL)


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 11},
], ids=["greedy", "sampled"])
def test_output_and_input_logprobs_match_the_reference(engine, reference, params):
    token_ids = [0, 5, 300]
    out = engine.generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 6, **params},
        return_logprob=True, logprob_start_len=3, top_logprobs_num=5,
        token_ids_logprob=token_ids,
    )
    meta, output = out["meta_info"], out["output_ids"]
    lp = ref_logprobs(reference, PROMPT + output, params["temperature"])
    n = len(PROMPT)
    check_positions(lp, meta["output_token_logprobs"], meta["output_top_logprobs"],
                    meta["output_token_ids_logprobs"], output, range(n - 1, n - 1 + len(output)),
                    token_ids)
    # Prompt positions 3..n-1: the logprob of token p given tokens < p (row p - 1).
    check_positions(lp, meta["input_token_logprobs"], meta["input_top_logprobs"],
                    meta["input_token_ids_logprobs"], PROMPT[3:], range(2, n - 1), token_ids)


def test_input_logprobs_from_zero_after_a_cache_hit_and_with_text(engine, reference):
    """The prompt was just cached by a request without logprobs: its logprobs are still
    computed (the cache is used only up to logprob_start_len). Position 0 has none."""
    engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
    out = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2,
                                                             "temperature": 0.0},
                          return_logprob=True, logprob_start_len=0,
                          return_text_in_logprobs=True)
    meta = out["meta_info"]
    first, *rest = meta["input_token_logprobs"]
    assert first[0] is None and first[1] == PROMPT[0]
    lp = ref_logprobs(reference, PROMPT + out["output_ids"], 0.0)
    assert len(rest) == len(PROMPT) - 1
    for p, (logprob, token, text) in enumerate(rest, start=1):
        assert token == PROMPT[p] and isinstance(text, str)
        assert abs(logprob - lp[p - 1, token]) < TOL + RTOL * abs(lp[p - 1, token])
    assert "input_top_logprobs" not in meta  # not asked


def test_streamed_logprobs_join_to_the_whole(engine):
    kwargs = dict(input_ids=PROMPT, sampling_params={"max_new_tokens": 5, "temperature": 0.0},
                  return_logprob=True, top_logprobs_num=2)
    whole = engine.generate(**kwargs)["meta_info"]
    joined: dict[str, list] = {}
    for chunk in engine.generate(stream=True, **kwargs):
        for key in ("output_token_logprobs", "output_top_logprobs"):
            joined.setdefault(key, []).extend(chunk["meta_info"].get(key, []))
    for key, values in joined.items():
        assert values == whole[key], key


@pytest.mark.parametrize("kwargs,needle", [
    (dict(top_logprobs_num=3), "needs return_logprob"),
    (dict(return_logprob=True, top_logprobs_num=21), r"\[0, 20\]"),
    (dict(return_logprob=True, logprob_start_len=len(PROMPT)), r"\[0, 12\)"),
    (dict(return_logprob=True, token_ids_logprob=[10**6]), "outside the vocabulary"),
])
def test_bad_logprob_options_are_value_errors(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 1}, **kwargs)


# -- OpenAI formats ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags(served_model_name="m"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_openai_completions_logprobs_with_echo(server, client, reference, stream):
    kwargs = dict(model="m", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3, echo=True)
    if stream:
        parts = list(client.completions.create(stream=True, **kwargs))
        text = "".join(p.choices[0].text for p in parts if p.choices)
        logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for p in parts:
            if p.choices and p.choices[0].logprobs:
                for key in logprobs:
                    logprobs[key] += getattr(p.choices[0].logprobs, key)
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, logprobs = choice.text, choice.logprobs.model_dump()
    n = len(PROMPT)
    assert len(logprobs["tokens"]) == n + 4 and logprobs["token_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == text  # the echo: prompt text, then the completion
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])
    output = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}).json()["output_ids"]
    lp = ref_logprobs(reference, PROMPT + output, 0.0)
    targets = PROMPT[1:] + output
    for p, (value, top) in enumerate(zip(logprobs["token_logprobs"][1:],
                                         logprobs["top_logprobs"][1:], strict=True)):
        assert abs(value - lp[p, targets[p]]) < TOL
        best = np.sort(lp[p])[::-1][:3]  # a dict by token text: equal texts merge
        assert 1 <= len(top) <= 3 and abs(max(top.values()) - best[0]) < TOL
        assert all(np.min(np.abs(best - v)) < TOL for v in top.values())


def test_openai_chat_logprobs(server, client, reference):
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8") == c.token
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob <= c.top_logprobs[0].logprob + TOL
    res = server.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert res.status_code == 400 and res.json()["error"]["param"] == "top_logprobs"
