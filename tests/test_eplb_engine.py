"""EPLB through the Engine and HTTP: rebalance_experts / POST /rebalance_experts between
requests, with greedy tokens and routed experts equal to the float64 reference before and
after, and no recompilation (one device: every physical expert on it, R = 2 replicas)."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, engine_args, server_flags
from tests.engine_utils import decoded_rows, expected_rows, prompt_ids, reference_greedy
from tests.server_utils import server_fixture

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 5}
CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
EPLB = {"enable_eplb": True, "ep_num_redundant_experts": 2, "enable_return_routed_experts": True}


def _check(outs: list[dict], prompts: list[list[int]]) -> None:
    for out, ids in zip(outs, prompts, strict=True):
        assert out["output_ids"] == reference_greedy(ids, 5)
        rows = decoded_rows(out, CFG.num_hidden_layers, CFG.num_experts_per_tok)
        np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"]))


def test_engine_rebalance_keeps_outputs_and_compiles():
    prompts = [[7] * 30, prompt_ids(5, 12), prompt_ids(6, 20)]
    with Engine(**engine_args(**EPLB)) as eng:
        _check(eng.generate(input_ids=prompts, sampling_params=GREEDY,
                            return_routed_experts=True), prompts)
        compiles = eng.get_server_info()["num_compiles"]
        out = eng.rebalance_experts()
        assert len(out["physical_to_logical"]) == len(CFG.moe_layer_ids)
        assert all(len(row) == CFG.num_experts + 2 for row in out["physical_to_logical"])
        _check(eng.generate(input_ids=prompts, sampling_params=GREEDY,
                            return_routed_experts=True), prompts)
        assert eng.get_server_info()["num_compiles"] == compiles
    with Engine(**engine_args(**EPLB, eplb_rebalance_num_iterations=3)) as eng:  # during
        _check(eng.generate(input_ids=prompts, sampling_params=GREEDY,
                            return_routed_experts=True), prompts)


def test_rebalance_without_eplb_refuses():
    with Engine(**engine_args()) as eng, pytest.raises(ValueError, match="--enable-eplb"):
        eng.rebalance_experts()


@pytest.fixture(scope="module")
def server(request):
    yield from server_fixture(request, server_flags(**EPLB))


def test_http_rebalance_experts(server):
    prompt = [7] * 16
    body = {"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True}
    first = requests.post(server.url + "/generate", json=body, timeout=60).json()
    r = requests.post(server.url + "/rebalance_experts", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and "imbalance_after" in r.json()
    second = requests.post(server.url + "/generate", json=body, timeout=60).json()
    assert first["output_ids"] == second["output_ids"] == reference_greedy(prompt, 5)
    _check([second], [prompt])
