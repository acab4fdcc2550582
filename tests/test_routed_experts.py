"""Return routed experts (M3): every row of every request equals the independent reference.

Baselines come from the float64 reference forward, teacher-forced over prompt + generated ids
(``seq_len - 1`` rows), never from the engine's own output.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.tools.make_random_model import write_random_model
from tests.engine_utils import (
    FAST_ENGINE_ARGS,
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
)

CFG = ModelConfig.from_hf(None)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def check_rows(ids: list[int], out: dict, start: int = 0, path: str | None = None) -> np.ndarray:
    layers = L if path is None else ModelConfig.from_hf(path).num_hidden_layers
    rows = decoded_rows(out, layers, K)
    meta = out["meta_info"]
    assert rows.shape[0] == meta["prompt_tokens"] + meta["completion_tokens"] - 1 - start
    kwargs = {} if path is None else {"path": path}
    want = expected_rows(ids, out["output_ids"], **kwargs)[start:]
    np.testing.assert_array_equal(rows, want)
    return rows


def run_concurrent(engine: Engine, prompts: list[list[int]], max_new: list[int], want: list[bool]):
    return engine.generate(
        input_ids=prompts,
        sampling_params=[{**GREEDY, "max_new_tokens": n} for n in max_new],
        return_routed_experts=want,
    )


@pytest.fixture(scope="module")
def engine_bs1():
    eng = Engine(**FAST_ENGINE_ARGS, precompile_bs_paddings=[1], enable_return_routed_experts=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        **{**FAST_ENGINE_ARGS, "precompile_token_paddings": [16, 64], "chunked_prefill_size": 64},
        precompile_bs_paddings=[4],
        max_total_tokens=400,
        schedule_conservativeness=0.0,  # admit greedily: decode must retract
        enable_return_routed_experts=True,
    )
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    for name in ("engine", "engine_bs1"):
        if name in request.fixturenames:
            assert_no_leak(request.getfixturevalue(name))


def test_01_single_request_bs_padding_one(engine_bs1):
    ids = prompt_ids(1, 20)
    out = engine_bs1.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10},
                              return_routed_experts=True)
    check_rows(ids, out)


def test_02_single_request_bs_padding_four(engine):
    ids = prompt_ids(2, 20)
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10},
                          return_routed_experts=True)
    check_rows(ids, out)


def test_03_three_requests_bs_padding_four(engine):
    prompts = [prompt_ids(30 + i, 5 + 9 * i) for i in range(3)]
    outs = run_concurrent(engine, prompts, [7, 12, 9], [True] * 3)
    for ids, out in zip(prompts, outs, strict=True):
        check_rows(ids, out)


def test_04_four_requests_bs_padding_four(engine):
    prompts = [prompt_ids(40 + i, 4 + 6 * i) for i in range(4)]
    outs = run_concurrent(engine, prompts, [8, 5, 11, 6], [True] * 4)
    for ids, out in zip(prompts, outs, strict=True):
        check_rows(ids, out)


def test_mixed_flags_in_one_batch(engine):
    prompts = [prompt_ids(50 + i, 10 + i) for i in range(3)]
    outs = run_concurrent(engine, prompts, [6, 6, 6], [True, False, True])
    check_rows(prompts[0], outs[0])
    assert "routed_experts" not in outs[1]["meta_info"]
    check_rows(prompts[2], outs[2])


def test_prefix_cache_hits(engine):
    ids = prompt_ids(60, 40)
    first = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4},
                            return_routed_experts=True)
    again = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 4},
                            return_routed_experts=True)
    assert again["meta_info"]["cached_tokens"] > 0
    np.testing.assert_array_equal(check_rows(ids, first), check_rows(ids, again))
    longer = ids + prompt_ids(61, 15)
    ext = engine.generate(input_ids=longer, sampling_params={**GREEDY, "max_new_tokens": 4},
                          return_routed_experts=True)
    assert ext["meta_info"]["cached_tokens"] >= 40
    check_rows(longer, ext)


def test_prefix_computed_without_capture_is_recomputed_for_capture(engine):
    ids = prompt_ids(65, 30)
    engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3})
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3},
                          return_routed_experts=True)
    check_rows(ids, out)


def test_chunked_prefill_longer_than_chunk(engine):
    ids = prompt_ids(70, 150)  # chunked_prefill_size is 64
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 5},
                          return_routed_experts=True)
    check_rows(ids, out)


def test_retraction_under_small_kv_pool(engine):
    before = engine.get_server_info()["num_retractions"]
    prompts = [prompt_ids(80 + i, 30 + 5 * i) for i in range(4)]
    outs = run_concurrent(engine, prompts, [90, 80, 85, 75], [True] * 4)
    assert engine.get_server_info()["num_retractions"] > before
    for ids, out in zip(prompts, outs, strict=True):
        check_rows(ids, out)


@pytest.mark.parametrize("start", [0, 7, 20])
def test_routed_experts_start_len(engine, start):
    ids = prompt_ids(90, 20)
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 5},
                          return_routed_experts=True, routed_experts_start_len=start)
    check_rows(ids, out, start=start)


def test_routed_experts_start_len_beyond_prompt_is_an_error(engine):
    with pytest.raises(ValueError, match=r"routed_experts_start_len=21 is outside \[0, 20\]"):
        engine.generate(input_ids=prompt_ids(90, 20), max_new_tokens=2,
                        return_routed_experts=True, routed_experts_start_len=21)
    with pytest.raises(ValueError, match="needs return_routed_experts"):
        engine.generate(input_ids=prompt_ids(90, 20), max_new_tokens=2, routed_experts_start_len=1)


def test_feature_changes_no_token_and_streaming_mix(engine):
    prompts = [prompt_ids(100 + i, 12) for i in range(4)]

    async def run():
        tasks = []
        for i, ids in enumerate(prompts):
            want = i % 2 == 0
            if i < 2:
                tasks.append(engine.async_generate(
                    input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 9},
                    return_routed_experts=want))
            else:
                async def stream(ids=ids, want=want):
                    agen = await engine.async_generate(
                        input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 9},
                        return_routed_experts=want, stream=True)
                    chunks = [c async for c in agen]
                    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
                    return {"output_ids": sum((c["output_ids"] for c in chunks), []),
                            "meta_info": chunks[-1]["meta_info"]}
                tasks.append(stream())
        return await asyncio.gather(*tasks)

    outs = asyncio.run(run())
    plain = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 9})
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out["output_ids"] == plain[i]["output_ids"]
        if i % 2 == 0:
            check_rows(ids, out)
        else:
            assert "routed_experts" not in out["meta_info"]


def test_dense_layers_hold_minus_one(tmp_path):
    path = str(tmp_path / "dense")
    write_random_model(path, "tiny", {"mlp_only_layers": [1, 3]}, seed=5)
    with Engine(**FAST_ENGINE_ARGS, model_path=path, precompile_bs_paddings=[1],
                enable_return_routed_experts=True) as eng:
        ids = prompt_ids(3, 15)
        out = eng.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 6},
                           return_routed_experts=True)
        rows = check_rows(ids, out, path=path)
        assert (rows[:, [1, 3]] == -1).all() and (rows[:, [0, 2]] >= 0).all()


def test_seed_example_script_runs():
    script = os.path.join(os.path.dirname(__file__), "..", "docs", "examples", "routed_experts_engine.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Expert IDs shape (reshaped)" in done.stdout
