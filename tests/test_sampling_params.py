"""SamplingParams: from_dict type checks, verify ranges, normalize, to_dict."""

from __future__ import annotations

import math

import pytest

from sgl_jax.srt.sampling.sampling_params import SamplingParams

VOCAB = 1000


def test_defaults_and_empty_inputs() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.stop is None and p.stop_token_ids is None and p.seed is None
    assert (p.ignore_eos, p.skip_special_tokens, p.n) == (False, True, 1)
    assert SamplingParams.from_dict(None) == p
    assert SamplingParams.from_dict({}) == p
    p.verify(VOCAB)


def test_from_dict_accepts_valid_values() -> None:
    p = SamplingParams.from_dict(
        {
            "max_new_tokens": 16,
            "temperature": 1,  # ints are fine for float fields
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "stop": ("a", "b"),
            "stop_token_ids": [1, 2],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "seed": 2**63 - 1,
            "n": 2,
            "frequency_penalty": 0.0,
            "presence_penalty": 0,
            "repetition_penalty": 1.0,
        }
    )
    assert p.max_new_tokens == 16 and isinstance(p.max_new_tokens, int)
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1, 2]
    assert p.ignore_eos is True and p.skip_special_tokens is False
    p.verify(VOCAB, context_len=16)


def test_from_dict_none_means_default() -> None:
    p = SamplingParams.from_dict({"temperature": None, "top_p": None, "max_new_tokens": None})
    assert p == SamplingParams()


def test_unknown_key_names_it_and_lists_accepted() -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"max_tokens": 5})
    msg = str(err.value)
    assert "'max_tokens'" in msg and "max_new_tokens" in msg and "temperature" in msg


def test_not_a_dict() -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("max_new_tokens", "10", "integer"),
        ("max_new_tokens", True, "integer"),
        ("max_new_tokens", 1.5, "integer"),
        # Integral floats too: integers are strict on every surface, as on the OpenAI routes.
        ("max_new_tokens", 100.0, "integer"),
        ("top_k", 4.0, "integer"),
        ("max_new_tokens", math.inf, "integer"),
        ("top_k", False, "integer"),
        ("n", [1], "integer"),
        ("seed", 3.25, "integer"),
        ("temperature", "hot", "number"),
        ("temperature", True, "number"),
        ("top_p", "0.9", "number"),
        ("min_p", [0.1], "number"),
        ("frequency_penalty", "0", "number"),
        ("ignore_eos", "yes", "boolean"),
        ("skip_special_tokens", 1, "boolean"),
        ("stop", 5, "string or a list of strings"),
        ("stop", ["ok", 1], "string or a list of strings"),
        ("stop_token_ids", 7, "list of integers"),
        ("stop_token_ids", [1, "2"], "list of integers"),
        ("stop_token_ids", [1, True], "list of integers"),
    ],
)
def test_from_dict_type_errors_name_field_and_type(key: str, value, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({key: value})
    msg = str(err.value)
    assert key in msg and expected in msg, msg


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 0}, "top_k must be -1 (whole vocabulary) or >= 1"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"min_p": 1.01}, "min_p"),
        ({"stop_token_ids": [5, VOCAB]}, f"stop_token_ids must be token ids in [0, {VOCAB})"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["a", ""]}, "stop strings must be non-empty"),
        ({"stop": [str(i) for i in range(17)]}, "stop accepts at most 16"),
        ({"stop": "x" * 1025}, "at most 1024 characters"),
        ({"stop_token_ids": [1] * 257}, "stop_token_ids accepts at most 256"),
        ({"seed": -1}, "seed must be in [0, 2**63)"),
        ({"seed": 2**63}, "seed"),
        ({"n": 0}, "n must be >= 1"),
        ({"frequency_penalty": 0.5}, "frequency_penalty is not supported"),
        ({"presence_penalty": -1.0}, "presence_penalty is not supported"),
        ({"repetition_penalty": 1.1}, "repetition_penalty is not supported"),
    ],
)
def test_verify_errors_name_field_and_allowed_values(kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs).verify(VOCAB)
    assert expected in str(err.value), str(err.value)


def test_verify_context_len() -> None:
    SamplingParams(max_new_tokens=64).verify(VOCAB, context_len=64)
    with pytest.raises(ValueError, match="max_new_tokens must be <= the context length 64"):
        SamplingParams(max_new_tokens=65).verify(VOCAB, context_len=64)


def test_verify_accepts_boundaries() -> None:
    for kwargs in [
        {"max_new_tokens": 0},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_k": 1},
        {"top_k": 10 * VOCAB},  # larger than the vocabulary: no truncation
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": [str(i) for i in range(16)]},
        {"stop_token_ids": [0, VOCAB - 1]},
    ]:
        SamplingParams(**kwargs).verify(VOCAB)


def test_normalize() -> None:
    p = SamplingParams(stop="###").normalize()
    assert p.stop == ["###"] and p.top_k == -1
    assert SamplingParams().normalize().stop == []
    assert SamplingParams(stop=("a", "b")).normalize().stop == ["a", "b"]

    greedy = SamplingParams(temperature=0.0, top_k=-1).normalize()
    assert greedy.is_greedy and greedy.top_k == 1 and greedy.temperature == 0.0
    assert SamplingParams(temperature=1e-7, top_k=50).normalize().top_k == 1
    assert SamplingParams(temperature=1e-5).normalize().top_k == -1

    # Idempotent.
    twice = SamplingParams(stop="x", temperature=0.0).normalize()
    assert twice.to_dict() == SamplingParams(**twice.to_dict()).normalize().to_dict()


def test_to_dict_round_trips_through_from_dict() -> None:
    p = SamplingParams(max_new_tokens=7, temperature=0.3, stop=["x"], stop_token_ids=[3], seed=9)
    d = p.to_dict()
    assert d["max_new_tokens"] == 7 and d["stop"] == ["x"] and d["seed"] == 9
    assert SamplingParams.from_dict(d) == p
