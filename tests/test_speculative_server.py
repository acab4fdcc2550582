"""An HTTP server with ``--speculative-algorithm EAGLE`` (the bundled model and its bundled
draft) or ``NGRAM`` (the test model) answers greedy requests, over the native and the OpenAI
routes, streaming or not, with the tokens and routed-experts rows of the float64 reference
(what the server without speculation returns), ``spec_verify_ct`` in ``meta_info``, and
``avg_spec_accept_length`` in ``/get_server_info``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH
from sgl_jax.testing import TEST_MODEL_PATH, server_flags
from tests.engine_utils import decoded_rows, expected_rows, prompt_ids, reference_greedy
from tests.server_utils import server_fixture, sse_events

NEW_TOKENS = 24
SETUPS = {"EAGLE": BUNDLED_MODEL_PATH, "NGRAM": TEST_MODEL_PATH}  # algorithm -> model


@pytest.fixture(scope="module", params=list(SETUPS))
def server(request):
    model = SETUPS[request.param]
    args = server_flags(
        model_path=model, speculative_algorithm=request.param, speculative_num_steps=3,
        enable_return_routed_experts=True, chunked_prefill_size=64,
        precompile_token_paddings=[64], precompile_bs_paddings=[4, 8])
    for s in server_fixture(request, args):
        s.model = model
        yield s


@pytest.fixture(scope="module")
def shape(server):
    info = server.get("/get_model_info").json()
    return info["num_hidden_layers"], info["num_experts_per_tok"]


def prompts() -> list[list[int]]:
    return [prompt_ids(seed, 6) * 4 for seed in range(4)] + [prompt_ids(9, 20)]


def test_native_route_concurrent_greedy_rows_equal_the_reference(server, shape):
    def generate(ids: list[int]) -> dict:
        resp = server.post("/generate", json={
            "input_ids": ids, "return_routed_experts": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                                "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    batch = prompts()
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(generate, batch))
    for ids, result in zip(batch, results, strict=True):
        assert result["output_ids"] == reference_greedy(ids, NEW_TOKENS, path=server.model)
        np.testing.assert_array_equal(decoded_rows(result, *shape),
                                      expected_rows(ids, result["output_ids"], server.model))
        assert 1 <= result["meta_info"]["spec_verify_ct"] <= NEW_TOKENS - 1
    assert server.get("/get_server_info").json()["avg_spec_accept_length"] > 1.0


def test_openai_completion_streamed_rows_equal_the_reference(server, shape):
    ids = prompts()[1]
    resp = server.post("/v1/completions", stream=True, json={
        "model": server.get("/v1/models").json()["data"][0]["id"], "prompt": ids,
        "max_tokens": NEW_TOKENS, "temperature": 0.0, "stream": True,
        "return_routed_experts": True, "ignore_eos": True})
    assert resp.status_code == 200
    # Every dict event but the one that carries the whole sglext (its choices are empty).
    events = [e for e in sse_events(resp) if isinstance(e, dict) and e.get("choices")]
    rows = [decoded_rows(e["choices"][0], *shape) for e in events
            if (e["choices"][0].get("meta_info") or {}).get("routed_experts")]
    want = reference_greedy(ids, NEW_TOKENS, path=server.model)
    np.testing.assert_array_equal(np.concatenate(rows), expected_rows(ids, want, server.model))


def test_openai_n_choices_each_equal_the_reference(server, shape):
    """n = 2 greedy choices are two requests, each with its own verify steps and rows."""
    ids = prompts()[2]
    resp = server.post("/v1/completions", json={
        "model": server.get("/v1/models").json()["data"][0]["id"], "prompt": ids,
        "max_tokens": NEW_TOKENS, "temperature": 0.0, "n": 2, "return_routed_experts": True,
        "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    want = reference_greedy(ids, NEW_TOKENS, path=server.model)
    assert len(choices) == 2
    for choice in choices:
        np.testing.assert_array_equal(decoded_rows(choice, *shape),
                                      expected_rows(ids, want, server.model))
        assert choice["meta_info"]["spec_verify_ct"] >= 1
