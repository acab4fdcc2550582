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
from sgl_jax.srt.routed_experts_codec import (
    encode_routed_experts,
    extract_routed_expert_weights_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.testing import TEST_MODEL_PATH, engine_args
from sgl_jax.tools.make_random_model import write_random_model
from tests.engine_utils import (
    assert_no_leak,
    decoded_rows,
    expected_rows,
    prompt_ids,
    reference,
)

CFG = ModelConfig.from_hf(TEST_MODEL_PATH)
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


def joined(chunks: list[dict]) -> dict:
    """A streamed request's chunks as one result: output ids and routed-experts rows joined
    (each chunk carries the rows completed since the previous one, consecutively)."""
    parts, pos = [], chunks[0]["meta_info"].get("routed_experts_start", 0)
    for c in chunks:
        meta = c["meta_info"]
        assert meta["routed_experts_start"] == pos
        part = extract_routed_experts_from_meta_info(c)
        pos += part.shape[0]
        parts.append(part)
    meta = {**chunks[-1]["meta_info"], "routed_experts": encode_routed_experts(np.concatenate(parts))}
    meta.pop("routed_experts_shape")
    return {"output_ids": sum((c["output_ids"] for c in chunks), []), "meta_info": meta}


def run_concurrent(engine: Engine, prompts: list[list[int]], max_new: list[int], want: list[bool]):
    return engine.generate(
        input_ids=prompts,
        sampling_params=[{**GREEDY, "max_new_tokens": n} for n in max_new],
        return_routed_experts=want,
    )


@pytest.fixture(scope="module")
def engine_bs1():
    eng = Engine(**engine_args(precompile_bs_paddings=[1], enable_return_routed_experts=True,
                               enable_return_routed_expert_weights=True))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine():
    eng = Engine(
        **engine_args(precompile_token_paddings=[16, 64], chunked_prefill_size=64,
                      precompile_bs_paddings=[4]),
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
    params = {**GREEDY, "max_new_tokens": 3}
    plain = engine.generate(input_ids=ids, sampling_params=params)
    shared = plain["meta_info"]["cached_tokens"]  # with earlier tests' prompts, by chance
    assert shared < 5
    out = engine.generate(input_ids=ids, sampling_params=params, return_routed_experts=True)
    assert out["meta_info"]["cached_tokens"] <= shared  # plain's KV has no rows: recomputed
    check_rows(ids, out)
    # The recomputed copy, with rows, replaced the cached one: the next request that asks
    # reuses the prefix (not poisoned forever), rows and all.
    again = engine.generate(input_ids=ids, sampling_params=params, return_routed_experts=True)
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    check_rows(ids, again)


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


def test_streamed_rows_survive_retraction(engine):
    """Streams whose requests are retracted and resumed: every chunk's rows continue where
    the previous ended, and together they equal the reference."""
    before = engine.get_server_info()["num_retractions"]
    prompts = [prompt_ids(180 + i, 30 + 5 * i) for i in range(4)]

    async def run():
        async def one(ids, n):
            agen = await engine.async_generate(
                input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": n},
                return_routed_experts=True, routed_experts_dtype="uint8", stream=True)
            return joined([c async for c in agen])
        return await asyncio.gather(*(one(ids, n) for ids, n in
                                      zip(prompts, [90, 80, 85, 75], strict=True)))

    outs = asyncio.run(run())
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
                    if not want:
                        assert all("routed_experts" not in c["meta_info"] for c in chunks)
                        return {"output_ids": sum((c["output_ids"] for c in chunks), []),
                                "meta_info": chunks[-1]["meta_info"]}
                    return joined(chunks)
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


def test_aborted_request_returns_the_rows_of_its_tokens(engine):
    """Through the real processes: an abort mid-decode returns the rows of every token that
    went through a forward (seq_len - 1 of what it generated so far), all correct."""
    ids = prompt_ids(95, 20)

    async def run():
        agen = await engine.async_generate(
            input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 300},
            return_routed_experts=True, stream=True, rid="abort-me")
        chunks = []
        async for chunk in agen:
            chunks.append(chunk)
            if len(chunks) == 3:
                engine.abort_request("abort-me")
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    out = joined(chunks)
    assert 3 <= len(out["output_ids"]) < 300
    check_rows(ids, out)


def test_dense_layers_and_wire_dtypes_with_300_experts(tmp_path):
    """Layers without a router hold -1 (signed dtypes) or the dtype's maximum (unsigned);
    every dtype carries the same ids; a dtype too narrow for 300 experts is a ValueError
    naming the limit; the server default applies to requests that give no dtype."""
    path = str(tmp_path / "dense")
    write_random_model(path, "tiny", {"mlp_only_layers": [1, 3], "num_experts": 300}, seed=5)
    with Engine(**engine_args(model_path=path, precompile_bs_paddings=[1],
                            enable_return_routed_experts=True,
                            routed_experts_dtype="int16")) as eng:
        ids = prompt_ids(3, 15)
        params = {**GREEDY, "max_new_tokens": 6}
        out = eng.generate(input_ids=ids, sampling_params=params, return_routed_experts=True,
                           routed_experts_dtype="int32")
        rows = check_rows(ids, out, path=path)
        assert (rows[:, [1, 3]] == -1).all() and (rows[:, [0, 2]] >= 0).all()
        assert (rows > 255).any()  # ids that uint8 could not hold
        for dtype, marker in ((None, -1), ("uint16", 65535)):
            got = eng.generate(input_ids=ids, sampling_params=params,
                               return_routed_experts=True, routed_experts_dtype=dtype)
            meta = got["meta_info"]
            name = dtype or "int16"  # the server's default
            assert meta["routed_experts_dtype"] == name
            assert meta["routed_experts_shape"] == [len(ids) + 6 - 1, 4, K]
            assert meta["routed_experts_start"] == 0
            typed = extract_routed_experts_from_meta_info(got)
            assert typed.dtype == np.dtype(name) and typed.shape == rows.shape
            np.testing.assert_array_equal(typed.astype(np.int64),
                                          np.where(rows < 0, marker, rows))
        with pytest.raises(ValueError, match="uint8 holds at most 255 expert ids.*300 experts"):
            eng.generate(input_ids=ids, sampling_params=params, return_routed_experts=True,
                         routed_experts_dtype="uint8")


def test_streamed_chunks_concatenate_to_the_whole():
    """Each chunk carries the rows completed since the previous one (routed_experts_start is
    its first row's position); together they equal the non-streamed rows and the reference."""
    interval = 2
    with Engine(**engine_args(precompile_bs_paddings=[1], stream_interval=interval,
                            enable_return_routed_experts=True)) as eng:
        for start, dtype in ((0, "int32"), (5, "uint8")):
            ids = prompt_ids(7 + start, 21)
            kwargs = dict(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 10},
                          return_routed_experts=True, routed_experts_start_len=start,
                          routed_experts_dtype=dtype)
            whole = eng.generate(**kwargs)
            chunks = list(eng.generate(stream=True, **kwargs))
            assert len(chunks) == 10 // interval
            pos, parts = start, []
            for c in chunks:
                meta = c["meta_info"]
                assert meta["routed_experts_start"] == pos
                assert meta["routed_experts_dtype"] == dtype
                part = extract_routed_experts_from_meta_info(c)
                assert part.dtype == np.dtype(dtype)
                assert list(part.shape) == meta["routed_experts_shape"]
                pos += part.shape[0]
                parts.append(part)
            # The first chunk: the prompt's rows and those of the tokens fed since; then one
            # row per token fed.
            assert parts[0].shape[0] == len(ids) + interval - 1 - start
            assert all(p.shape[0] == interval for p in parts[1:])
            streamed = np.concatenate(parts)
            assert streamed.shape[0] == len(ids) + 10 - 1 - start
            np.testing.assert_array_equal(streamed, extract_routed_experts_from_meta_info(whole))
            assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
            want = expected_rows(ids, whole["output_ids"])[start:]
            np.testing.assert_array_equal(streamed.astype(np.int64), want)


def test_routing_weights_match_the_reference_streamed_or_not(engine_bs1):
    """return_routed_expert_weights: the router's top-k weights of every row (float32 by
    default, float16 on request), beside the ids and by the same rules, streaming included;
    they equal the float64 reference's (softmax, top-k, norm_topk_prob) within float32
    rounding."""
    ids = prompt_ids(31, 17)
    kwargs = dict(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 7},
                  return_routed_experts=True, return_routed_expert_weights=True,
                  routed_experts_start_len=2)
    whole = engine_bs1.generate(**kwargs)
    meta = whole["meta_info"]
    check_rows(ids, whole, start=2)
    weights = extract_routed_expert_weights_from_meta_info(whole)
    assert weights.dtype == np.float32 and meta["routed_expert_weights_dtype"] == "float32"
    assert list(weights.shape) == meta["routed_expert_weights_shape"] == meta["routed_experts_shape"]
    ref = reference().forward(ids + whole["output_ids"][:-1])
    np.testing.assert_allclose(weights, ref.topk_weights[2:], rtol=1e-5, atol=1e-6)
    assert (np.diff(weights, axis=-1) <= 0).all()  # the router's order: descending weight

    chunks = list(engine_bs1.generate(stream=True, routed_expert_weights_dtype="float16",
                                      **kwargs))
    assert len(chunks) == 7
    parts = [extract_routed_expert_weights_from_meta_info(c) for c in chunks]
    assert all(p.dtype == np.float16 for p in parts)
    assert [len(p) for p in parts] == [c["meta_info"]["routed_experts_shape"][0] for c in chunks]
    np.testing.assert_array_equal(np.concatenate(parts), weights.astype(np.float16))
    assert joined(chunks)["output_ids"] == whole["output_ids"]
    # Not asked: no weights keys.
    plain = engine_bs1.generate(input_ids=ids, max_new_tokens=2, return_routed_experts=True)
    assert not any(k.startswith("routed_expert_weights") for k in plain["meta_info"])
    with pytest.raises(ValueError, match="needs return_routed_experts"):
        engine_bs1.generate(input_ids=ids, max_new_tokens=2, return_routed_expert_weights=True)


def test_numpy_format_hands_back_arrays_without_base64(engine_bs1):
    """Engine.generate(routed_experts_format="numpy") (M21): the rows and weights as numpy
    arrays of the wire dtypes, shaped [rows, layers, k], equal to the reference and to the
    base64 result; streamed and split alike."""
    ids = prompt_ids(41, 12)
    kwargs = dict(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 6},
                  return_routed_experts=True, return_routed_expert_weights=True,
                  routed_experts_dtype="uint8")
    as_base64 = engine_bs1.generate(**kwargs)
    out = engine_bs1.generate(routed_experts_format="numpy", **kwargs)
    meta = out["meta_info"]
    rows, weights = meta["routed_experts"], meta["routed_expert_weights"]
    assert isinstance(rows, np.ndarray) and isinstance(weights, np.ndarray)
    assert rows.dtype == np.uint8 and weights.dtype == np.float32
    assert list(rows.shape) == meta["routed_experts_shape"] == [len(ids) + 6 - 1, L, K]
    np.testing.assert_array_equal(rows, expected_rows(ids, out["output_ids"]))
    np.testing.assert_array_equal(rows, extract_routed_experts_from_meta_info(as_base64))
    np.testing.assert_allclose(weights, extract_routed_expert_weights_from_meta_info(as_base64),
                               rtol=1e-5, atol=1e-6)
    assert extract_routed_experts_from_meta_info(out) is not None  # the helper takes arrays

    chunks = list(engine_bs1.generate(stream=True, routed_experts_format="numpy", **kwargs))
    assert all(isinstance(c["meta_info"]["routed_experts"], np.ndarray) for c in chunks)
    np.testing.assert_array_equal(
        np.concatenate([c["meta_info"]["routed_experts"] for c in chunks]), rows)

    split = engine_bs1.generate(input_ids=[ids, ids], max_new_tokens=3, return_routed_experts=True,
                                routed_experts_split=True, routed_experts_format="numpy")
    prompt_rows = split[0]["meta_info"]["prompt_routed_experts"]
    assert isinstance(prompt_rows, np.ndarray) and prompt_rows.dtype == np.int32
    np.testing.assert_array_equal(prompt_rows, rows[:len(ids)].astype(np.int32))
    with pytest.raises(ValueError, match="routed_experts_format"):
        engine_bs1.generate(input_ids=ids, max_new_tokens=1, return_routed_experts=True,
                            routed_experts_format="npy")


def test_routing_weights_need_their_server_flag(engine):
    with pytest.raises(ValueError, match="--enable-return-routed-expert-weights"):
        engine.generate(input_ids=prompt_ids(3, 5), max_new_tokens=2, return_routed_experts=True,
                        return_routed_expert_weights=True)
    assert "routed_experts_host_cache" in engine.get_server_info()["memory_bytes"]


def test_seed_example_script_runs():
    script = os.path.join(os.path.dirname(__file__), "..", "docs", "examples", "routed_experts_engine.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Expert IDs shape (reshaped)" in done.stdout
