"""The Engine with KV pages of 4 and 16 tokens, end to end, against the float64 reference.

Greedy outputs and routed-experts rows must equal the reference whatever the page size, with
concurrent requests sharing prefixes (cached in whole pages), chunked prefill and retraction in
a small KV pool; after every test nothing leaks (free + evictable == total, nothing locked).
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference_greedy,
)

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=[4, 16], ids=lambda p: f"page{p}")
def engine(request):
    eng = Engine(
        **engine_args(precompile_token_paddings=[16, 64], chunked_prefill_size=64,
                      precompile_bs_paddings=[4]),
        page_size=request.param,
        max_total_tokens=256,  # 64 pages of 4, 16 pages of 16: decode must retract
        schedule_conservativeness=0.0,
        enable_return_routed_experts=True,
    )
    eng.page_size = request.param
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(engine):
    yield
    assert_no_leak(engine)


def check(ids: list[int], out: dict, n: int, rows: bool = True) -> None:
    assert out["output_ids"] == reference_greedy(ids, n)
    if rows:
        np.testing.assert_array_equal(decoded_rows(out, L, K), expected_rows(ids, out["output_ids"]))
    else:
        assert "routed_experts" not in out["meta_info"]


def test_shared_prefixes_are_cached_in_whole_pages(engine):
    page = engine.page_size
    shared = prompt_ids(1, 37)
    warm = engine.generate(input_ids=shared + prompt_ids(2, 3),
                           sampling_params={**GREEDY, "max_new_tokens": 3},
                           return_routed_experts=True)
    check(shared + prompt_ids(2, 3), warm, 3)
    # Concurrent: some extend the cached prefix, some diverge inside a page of it, one is
    # longer than a prefill chunk.
    prompts = [
        shared + prompt_ids(10, 9),
        shared[:21] + prompt_ids(11, 6),
        shared + prompt_ids(12, 30),
        prompt_ids(13, 5),
        shared[:33] + prompt_ids(14, 40),
    ]
    lens = [9, 6, 11, 7, 5]
    want = [True, False, True, True, True]
    outs = engine.generate(
        input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens],
        return_routed_experts=want,
    )
    for ids, n, w, out in zip(prompts, lens, want, outs, strict=True):
        check(ids, out, n, rows=w)
        cached = out["meta_info"]["cached_tokens"]
        assert cached % page == 0 and cached <= len(ids) - 1
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached[0] == 37 - 37 % page and cached[2] == 37 - 37 % page
    assert cached[1] == 21 - 21 % page and cached[3] == 0


def test_retraction_in_a_small_kv_pool(engine):
    before = engine.get_server_info()["num_retractions"]
    prompts = [prompt_ids(80 + i, 30 + 5 * i) for i in range(4)]
    lens = [90, 80, 85, 75]
    outs = engine.generate(
        input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens],
        return_routed_experts=[True, True, False, True],
    )
    assert engine.get_server_info()["num_retractions"] > before
    for i, (ids, n, out) in enumerate(zip(prompts, lens, outs, strict=True)):
        check(ids, out, n, rows=i != 2)


def test_a_prompt_larger_than_the_kv_cache_is_refused(engine):
    out = engine.generate(input_ids=prompt_ids(5, 256), max_new_tokens=2)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "KV slots" in out["meta_info"]["finish_reason"]["message"]
