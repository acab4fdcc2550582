"""An HTTP server with data-parallel attention (M19): ``--tp-size 2 --ep-size 2
--enable-dp-attention --dp-size 2`` on 4 fake CPU devices serves concurrent requests whose
greedy tokens and routed-experts rows equal the float64 reference, on both attention ranks
at once, and keeps serving after an abort."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from sgl_jax.testing import fake_devices_flags, server_flags
from tests.engine_utils import (
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference,
    reference_greedy,
)
from tests.server_utils import server_fixture, sse_events
from tests.test_logprobs import check_positions, ref_logprobs

DP_ARGS = server_flags(
    tp_size=2, ep_size=2, enable_dp_attention=True, dp_size=2,
    enable_return_routed_experts=True, max_running_requests=8, chunked_prefill_size=64,
    precompile_token_paddings=[64], precompile_bs_paddings=[4], max_total_tokens=1024,
)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(
        request, DP_ARGS, env={"XLA_FLAGS": fake_devices_flags(4)})


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
    # Both ranks served requests (round robin over 6 concurrent prompts): each rank's radix
    # tree now holds some of them, and nothing is left locked or running.
    ranks = info["dp_ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert all(r["evictable_kv_slots"] > 0 and r["locked_kv_slots"] == 0 for r in ranks), info
    assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0
    loads = server.get("/get_load").json()
    assert [x["dp_rank"] for x in loads] == [0, 1] and all(x["num_tokens"] == 0 for x in loads)


def test_prefix_hit_abort_and_still_serving(server, model_info):
    ids = prompt_ids(99, 48)
    first = _generate(server, ids)
    again = _generate(server, ids)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"] == reference_greedy(ids, NEW_TOKENS)
    layers, top_k = model_info["num_hidden_layers"], model_info["num_experts_per_tok"]
    np.testing.assert_array_equal(decoded_rows(again, layers, top_k),
                                  expected_rows(ids, again["output_ids"]))
    # A long request aborted by its id while it generates: it ends, aborted, and the ranks
    # keep serving with nothing leaked.
    body = {"input_ids": prompt_ids(5, 20), "rid": "dp-long", "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}}
    with server.post("/generate", json=body, stream=True) as resp:
        lines = resp.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: "))  # it is running
        assert server.post("/abort_request", json={"rid": "dp-long"}).status_code == 200
        events = sse_events(lines)
    finals = [e for e in events if isinstance(e, dict)]
    assert finals and finals[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(finals[-1]["output_ids"]) < 200
    assert _generate(server, ids)["output_ids"] == first["output_ids"]
    info = server.get("/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["locked_kv_slots"] == 0


def test_logprobs_on_both_ranks_match_the_reference(server):
    """Output and input logprobs (the extra prompt rows are laid out per rank too) of
    concurrent requests, against the float64 reference."""
    prompts = [prompt_ids(40 + seed, n) for seed, n in enumerate((12, 21, 7, 16))]

    def run(ids: list[int]) -> dict:
        resp = server.post("/generate", json={
            "input_ids": ids, "return_logprob": True, "logprob_start_len": 3,
            "top_logprobs_num": 5, "token_ids_logprob": [0, 5, 300],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 5}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    ref = reference()
    for ids, out in zip(prompts, results, strict=True):
        meta, output = out["meta_info"], out["output_ids"]
        lp = ref_logprobs(ref, ids + output, 0.0)
        n = len(ids)
        check_positions(lp, meta["output_token_logprobs"], meta["output_top_logprobs"],
                        meta["output_token_ids_logprobs"], output,
                        range(n - 1, n - 1 + len(output)), [0, 5, 300])
        check_positions(lp, meta["input_token_logprobs"], meta["input_top_logprobs"],
                        meta["input_token_ids_logprobs"], ids[3:], range(2, n - 1),
                        [0, 5, 300])
