"""An HTTP server with data-parallel attention (M19): ``--tp-size 2 --ep-size 2
--enable-dp-attention --dp-size 2`` on 4 fake CPU devices serves concurrent requests whose
greedy tokens and routed-experts rows equal the float64 reference, on both attention ranks
at once, and keeps serving after an abort."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.engine_utils import decoded_rows, expected_rows, prompt_ids, reference_greedy
from tests.server_utils import server_fixture

DP_ARGS = [
    "--tp-size", "2", "--ep-size", "2", "--enable-dp-attention", "--dp-size", "2",
    "--enable-return-routed-experts", "--max-running-requests", "8",
    "--chunked-prefill-size", "64", "--precompile-token-paddings", "64",
    "--precompile-bs-paddings", "4", "--max-total-tokens", "1024",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(
        request, DP_ARGS, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})


@pytest.fixture(scope="module")
def model_info(server):
    return server.get("/get_model_info").json()


def _generate(server, ids: list[int]) -> dict:
    resp = server.post("/generate", json={
        "input_ids": ids, "return_routed_experts": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW_TOKENS,
                            "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_concurrent_requests_on_both_ranks_match_the_reference(server, model_info):
    prompts = [prompt_ids(seed, n) for seed, n in enumerate((9, 30, 5, 17, 40, 12))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: _generate(server, ids), prompts))
    layers, top_k = model_info["num_hidden_layers"], model_info["num_experts_per_tok"]
    for ids, result in zip(prompts, results, strict=True):
        out = result["output_ids"]
        assert out == reference_greedy(ids, NEW_TOKENS)
        np.testing.assert_array_equal(decoded_rows(result, layers, top_k),
                                      expected_rows(ids, out))
    info = server.get("/get_server_info").json()
    assert info["dp_size"] == 2
    # Both ranks served requests (round robin over 6 concurrent requests).
    assert all(n > 0 for n in info["dp_requests_served"]), info


def test_prefix_hit_and_abort_then_still_serving(server, model_info):
    ids = prompt_ids(99, 48)
    first = _generate(server, ids)
    again = _generate(server, ids)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"] == reference_greedy(ids, NEW_TOKENS)
    resp = server.post("/abort_request", json={"rid": "no-such-request"})
    assert resp.status_code in (200, 404)
    layers, top_k = model_info["num_hidden_layers"], model_info["num_experts_per_tok"]
    np.testing.assert_array_equal(decoded_rows(again, layers, top_k),
                                  expected_rows(ids, again["output_ids"]))
