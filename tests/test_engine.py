"""The Engine end to end (M2): real processes, ZMQ, tokenizer; results against the reference."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from sgl_jax import Engine
from sgl_jax.testing import engine_args
from tests.engine_utils import assert_no_leak, prompt_ids, reference_greedy

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    # A small KV pool and chunk so that chunking, prefix hits and retraction all happen.
    eng = Engine(
        **engine_args(precompile_token_paddings=[16, 64], chunked_prefill_size=64,
                      precompile_bs_paddings=[1, 4, 16]),
        max_total_tokens=640,
        schedule_conservativeness=0.0,  # admit greedily: decode must retract
    )
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def no_leaks(engine):
    yield
    assert_no_leak(engine)


def test_greedy_matches_reference_alone(engine):
    for seed, (n_prompt, n_out) in enumerate([(5, 12), (40, 8), (100, 6)]):
        ids = prompt_ids(seed, n_prompt)
        out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": n_out})
        assert out["output_ids"] == reference_greedy(ids, n_out)
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (n_prompt, n_out)
        assert meta["finish_reason"] == {"type": "length", "length": n_out}
        assert meta["e2e_latency"] > 0


def test_sixteen_concurrent_requests_batching_chunking_prefix_and_retraction(engine):
    shared = prompt_ids(1000, 48)
    prompts, lens = [], []
    for i in range(16):
        tail = prompt_ids(2000 + i, 3 + 7 * (i % 5))
        prompts.append(shared + tail if i % 2 == 0 else tail + shared[: 10 + i])
        lens.append(6 + (i * 5) % 20)
    before = engine.get_server_info()
    outs = engine.generate(
        input_ids=prompts,
        sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens],
    )
    after = engine.get_server_info()
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        assert out["output_ids"] == reference_greedy(ids, n)
    assert any(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert after["num_retractions"] > before["num_retractions"]


def test_streaming_concatenates_to_full_text(engine):
    params = {**GREEDY, "max_new_tokens": 20}
    full = engine.generate(prompt="The quick brown fox", sampling_params=params)
    chunks = list(engine.generate(prompt="The quick brown fox", sampling_params=params, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stop_token_ids_and_stop_strings(engine):
    ids = prompt_ids(77, 20)
    free = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24})
    out_ids = free["output_ids"]
    stop_id = out_ids[5]
    first = out_ids.index(stop_id)
    out = engine.generate(
        input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24, "stop_token_ids": [stop_id]}
    )
    assert out["output_ids"] == out_ids[: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}

    text = free["text"]
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    out = engine.generate(
        input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    assert stop not in out["text"]


def test_keyword_sampling_args(engine):
    out = engine.generate(prompt="Hello", max_new_tokens=3, temperature=0.0, ignore_eos=True)
    assert out["meta_info"]["completion_tokens"] == 3
    with pytest.raises(TypeError, match="unknown keyword"):
        engine.generate(prompt="Hello", max_tokens=3)


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_new_tokens": 12, "ignore_eos": True}
    ids = prompt_ids(5, 10)
    alone = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    batch = engine.generate(
        input_ids=[prompt_ids(6, 30), ids, prompt_ids(7, 3)],
        sampling_params=[{**params, "seed": 9}, params, {**params, "seed": 10}],
    )
    assert batch[1]["output_ids"] == alone
    other = engine.generate(input_ids=ids, sampling_params={**params, "seed": 4321})["output_ids"]
    assert other != alone


def test_bad_input_raises_value_error(engine):
    cases = [
        (dict(input_ids=[]), "empty"),
        (dict(input_ids=[100000]), "outside the vocabulary"),
        (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
        (dict(prompt="hi", sampling_params={"max_new_tokens": 10**6}), "max_new_tokens"),
        (dict(prompt="hi", return_routed_experts=True), "--enable-return-routed-experts"),
        (dict(input_ids=[1] * 5000), "context length"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(**kwargs)
    assert engine.generate(prompt="still serving", max_new_tokens=2)["meta_info"]["completion_tokens"] <= 2


def test_abort_running_and_queued(engine):
    long = {**GREEDY, "max_new_tokens": 600}

    async def run():
        start = (await engine.tokenizer_manager.get_server_info())["num_generated_tokens"]
        running = [
            asyncio.create_task(engine.async_generate(input_ids=prompt_ids(50 + i, 8), sampling_params=long, rid=f"run{i}"))
            for i in range(16)
        ]
        queued = asyncio.create_task(
            engine.async_generate(input_ids=prompt_ids(99, 8), sampling_params=long, rid="queued")
        )
        while (await engine.tokenizer_manager.get_server_info())["num_generated_tokens"] <= start:
            await asyncio.sleep(0.01)
        engine.abort_request("queued")
        for i in range(16):
            engine.abort_request(f"run{i}")
        return await asyncio.gather(*running, queued)

    results = asyncio.run(run())
    reasons = [r["meta_info"]["finish_reason"] for r in results]
    assert all(r["type"] == "abort" for r in reasons), reasons
    assert results[-1]["meta_info"]["completion_tokens"] == 0


def test_async_streaming(engine):
    async def run():
        agen = await engine.async_generate(prompt="stream me", max_new_tokens=5, stream=True,
                                           temperature=0.0, ignore_eos=True)
        return [c async for c in agen]

    chunks = asyncio.run(run())
    assert sum(len(c["output_ids"]) for c in chunks) == 5


def test_killed_scheduler_fails_fast_and_shutdown_leaves_no_children():
    eng = Engine(**engine_args(precompile_bs_paddings=[1]))
    pids = eng.child_pids()
    assert eng.generate(prompt="hi", max_new_tokens=2)["meta_info"]["completion_tokens"] <= 2
    os.kill(pids["scheduler"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="scheduler process died"):
        eng.generate(prompt="hi", max_new_tokens=2)
    assert time.monotonic() - t0 < 5
    eng.shutdown()
    time.sleep(0.2)
    for pid in pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_context_manager_shutdown():
    with Engine(**engine_args(precompile_bs_paddings=[1])) as eng:
        pids = eng.child_pids()
    time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids.values())


def test_overlap_schedule_gives_identical_results(engine):
    prompts = [prompt_ids(500 + i, 5 + 13 * i) for i in range(6)]
    params = [
        {"max_new_tokens": 10 + i, "temperature": 0.8 if i % 2 else 0.0, "seed": 7 + i,
         "ignore_eos": True}
        for i in range(6)
    ]
    with Engine(**engine_args(precompile_bs_paddings=[1, 4, 16]),
                disable_overlap_schedule=True) as sequential:
        expected = sequential.generate(input_ids=prompts, sampling_params=params)
    got = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]


def test_no_recompilation_after_warm_up(engine):
    before = engine.get_server_info()["num_compiles"]
    prompts = [prompt_ids(600 + i, 3 + 17 * i) for i in range(10)]
    engine.generate(input_ids=prompts,
                    sampling_params=[{**GREEDY, "max_new_tokens": 3 + 4 * i} for i in range(10)])
    list(engine.generate(prompt="streaming too", max_new_tokens=5, stream=True))
    assert engine.get_server_info()["num_compiles"] == before
