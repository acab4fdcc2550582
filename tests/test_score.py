"""Scoring (M18 item 4): ``Engine.score`` and the equivalent ``/generate`` body.

Every logprob is checked against the independent float64 reference forward of prompt +
completion (``log_softmax(logits / T)``), the routed experts against the reference's routing,
and the reuse of a shared prompt against the engine's ``cached_tokens``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.testing import engine_args, server_flags, wait_until
from tests.engine_utils import assert_no_leak, expected_rows, prompt_ids, reference
from tests.server_utils import server_fixture
from tests.test_logprobs import RTOL, TOL, ref_logprobs

PROMPT = prompt_ids(1, 20)
COMPLETIONS = [prompt_ids(2, 5), prompt_ids(3, 9), prompt_ids(4, 1)]


@pytest.fixture(scope="module")
def engine():
    eng = Engine(**engine_args(enable_return_routed_experts=True))
    yield eng
    eng.shutdown()


def check_logprobs(records: list[dict], prompts: list[list[int]], completions: list[list[int]],
                   temperature: float) -> None:
    assert len(records) == len(completions)
    for rec, prompt, completion in zip(records, prompts, completions, strict=True):
        lp = ref_logprobs(reference(), prompt + completion, temperature)
        want = lp[np.arange(len(prompt) - 1, len(prompt) + len(completion) - 1), completion]
        got = np.asarray(rec["logprobs"])
        assert got.shape == (len(completion),)
        np.testing.assert_allclose(got, want, atol=TOL, rtol=RTOL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_is_computed_once_and_matches_the_reference(engine, temperature):
    engine.flush_cache()
    records = engine.score(PROMPT, COMPLETIONS, temperature=temperature)
    check_logprobs(records, [PROMPT] * 3, COMPLETIONS, temperature)
    # The prompt was prefilled alone first: every completion took it from the prefix cache up
    # to the token before its first scored position (page size 1).
    assert [r["cached_tokens"] for r in records] == [len(PROMPT) - 1] * 3
    assert "routed_experts" not in records[0]
    assert_no_leak(engine)


def test_per_completion_prompts(engine):
    engine.flush_cache()
    prompts = [prompt_ids(10 + i, 6 + 3 * i) for i in range(3)]
    records = engine.score(prompts, COMPLETIONS, temperature=0.7)
    check_logprobs(records, prompts, COMPLETIONS, 0.7)
    assert [r["cached_tokens"] for r in records] == [0, 0, 0]  # nothing shared, nothing warmed
    # Greedy scoring (temperature 0) is the T = 1 distribution, as for generated tokens.
    check_logprobs(engine.score(prompts, COMPLETIONS, temperature=0.0), prompts, COMPLETIONS,
                   1.0)


def test_routed_experts_equal_the_reference(engine):
    engine.flush_cache()
    prompts = [PROMPT, PROMPT, prompt_ids(20, 7)]
    records = engine.score(prompts, COMPLETIONS, return_routed_experts=True)
    check_logprobs(records, prompts, COMPLETIONS, 1.0)
    for rec, prompt, completion in zip(records, prompts, COMPLETIONS, strict=True):
        rows = rec["routed_experts"]
        assert rows.dtype == np.int32
        assert rows.shape[0] == len(prompt) + len(completion) - 1
        np.testing.assert_array_equal(rows, expected_rows(prompt, completion))
    # The shared prompt's KV and rows came from its own prefill; the lone prompt's did not.
    assert [r["cached_tokens"] for r in records] == [len(PROMPT) - 1] * 2 + [0]
    assert_no_leak(engine)


def test_async_score(engine):
    async def run():
        return await engine.async_score(PROMPT, COMPLETIONS[:2])

    check_logprobs(asyncio.run(run()), [PROMPT] * 2, COMPLETIONS[:2], 1.0)


def test_an_aborted_score_raises(engine):
    """A score whose requests are aborted (here by a weight update that aborts everything,
    while generation is paused) raises instead of returning short logprobs."""
    import threading

    errors: list[BaseException] = []

    def score() -> None:
        try:
            engine.score([5, 6, 7], [[8, 9, 10]])
        except BaseException as e:  # noqa: BLE001 - what the caller sees
            errors.append(e)

    engine.pause_generation()
    thread = threading.Thread(target=score)
    try:
        thread.start()
        assert wait_until(lambda: engine.get_server_info()["num_waiting_reqs"] > 0, timeout=30)
        engine.update_weights_from_disk(engine.server_args.model_path, abort_all_requests=True)
    finally:
        engine.continue_generation()
        thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "ended with 0 logprobs" in str(errors[0])
    assert_no_leak(engine)


@pytest.mark.parametrize("prompts,completions,needle", [
    (PROMPT, [[1, 2], []], "completion 1 is empty"),
    (PROMPT, [], "non-empty list of lists"),
    ([], [[1]], "'prompt_ids' must be"),
    ([[1], []], [[1], [2]], "prompt 1 is empty"),
    (PROMPT, [[1, 512]], r"completion 0 holds 512, outside the vocabulary \[0, 512\)"),
    ([1, -1], [[1]], "the prompt holds -1"),
    (PROMPT, [[1] * 4076], "4096, so they must be shorter"),
    ([[1], [2]], [[1]], "2 prompts for 1 completions"),
    (PROMPT, [[1, True]], "lists of token ids"),
])
def test_bad_input_is_a_value_error(engine, prompts, completions, needle):
    with pytest.raises(ValueError, match=needle):
        engine.score(prompts, completions)
    assert_no_leak(engine)


# -- the same over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags(enable_return_routed_experts=True))


def test_generate_body_equals_score(server, engine):
    completion = COMPLETIONS[1]
    body = {"input_ids": PROMPT + completion,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
            "return_logprob": True, "logprob_start_len": len(PROMPT),
            "return_routed_experts": True}
    res = server.post("/generate", json=body)
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    entries = out["meta_info"]["input_token_logprobs"]
    assert [token for _, token, _ in entries] == completion
    record = engine.score(PROMPT, [completion], temperature=0.7,
                          return_routed_experts=True)[0]
    np.testing.assert_allclose([v for v, _, _ in entries], record["logprobs"], atol=TOL,
                               rtol=RTOL)
    check_logprobs([{"logprobs": [v for v, _, _ in entries]}], [PROMPT], [completion], 0.7)
    from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info

    rows = extract_routed_experts_from_meta_info(out).reshape(record["routed_experts"].shape)
    np.testing.assert_array_equal(rows, record["routed_experts"])


@pytest.mark.parametrize("body,param", [
    ({"input_ids": PROMPT + [512]}, "input_ids"),
    ({"input_ids": [1] * 4096}, "input_ids"),
    ({"input_ids": PROMPT, "logprob_start_len": len(PROMPT)}, "logprob_start_len"),
])
def test_bad_generate_bodies_are_400(server, body, param):
    full = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 3, **body}
    res = server.post("/generate", json=full)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["message"]
    if param == "logprob_start_len":
        assert res.json()["error"]["param"] == param
