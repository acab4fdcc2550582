"""Qwen3.5-MoE served end to end against the float64 reference forward
(``sgl_jax/tools/reference_qwen35.py``, which shares no code with the engine).

A ``tiny-qwen3.5-moe`` random checkpoint (three Gated DeltaNet layers, then one gated-attention
layer; routers redrawn until every selection gap clears 1e-3) is served by an Engine with
``--enable-return-routed-experts`` and prefill chunks of 96 tokens:

- a 150-token prompt (two prefill chunks: the linear layers' conv and recurrent states carried
  from the first chunk to the second, and the first chunk spanning more than the delta rule's
  64-token chunk) and a 23-token one, batched, then decoded greedily: every token and every
  routed-expert row equal the reference's;
- the same long prompt again after the slot was used (a fresh request starts from zero
  states, whatever its slot's previous owner left);
- the refusals by name (speculative decoding, TP) and the prefix cache turned off.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.server_args_checks import check_for_linear_attention
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model
from sgl_jax.tools.reference_qwen35 import Qwen35Reference
from tests.engine_utils import assert_no_leak, decoded_rows, prompt_ids

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen35") / "tiny-qwen3.5-moe")
    write_random_model(path, "tiny-qwen3.5-moe", seed=0)
    return path


@functools.lru_cache(maxsize=8)
def _reference(path: str) -> Qwen35Reference:
    return Qwen35Reference(path)


def reference_greedy(path: str, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens by full float64 forwards, and the routed rows of prompt + output[:-1]."""
    ref, seq = _reference(path), list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(ref.forward(seq).logits[-1])))
    return seq[len(ids):], ref.forward(seq[:-1]).topk_ids


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine(**engine_args(model_path=checkpoint, enable_return_routed_experts=True,
                               chunked_prefill_size=96, precompile_token_paddings=[32, 96],
                               precompile_bs_paddings=[1, 2]))
    yield eng
    eng.shutdown()


def _check(out: dict, ids: list[int], path: str) -> None:
    cfg = ModelConfig.from_hf(path)
    tokens, rows = reference_greedy(path, ids, NEW_TOKENS)
    assert out["output_ids"] == tokens
    got = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert got.shape == rows.shape
    np.testing.assert_array_equal(got, rows)  # every row of every layer


def test_chunked_prefill_then_decode_matches_reference(engine, checkpoint):
    long_prompt, short_prompt = prompt_ids(300, 150), prompt_ids(301, 23)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    outs = engine.generate(input_ids=[long_prompt, short_prompt], sampling_params=params,
                           return_routed_experts=True)
    for out, ids in zip(outs, (long_prompt, short_prompt), strict=True):
        _check(out, ids, checkpoint)
    # The long prompt again: a new request on a used slot starts from zero states, and no
    # prefix is reused (the prefix cache is off for linear-attention models).
    again = engine.generate(input_ids=long_prompt, sampling_params=params,
                            return_routed_experts=True)
    assert again["meta_info"].get("cached_tokens", 0) == 0
    _check(again, long_prompt, checkpoint)
    assert_no_leak(engine)


def test_refusals_name_the_flag(checkpoint):
    cfg = ModelConfig.from_hf(checkpoint)
    for flags, flag in (({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
                        ({"tp_size": 2}, "--tp-size")):
        args = ServerArgs(model_path=checkpoint, **flags)
        with pytest.raises(ValueError, match=f"{flag}.*qwen3_5_moe"):
            check_for_linear_attention(args, cfg.linear_layers, cfg.family)
    args = ServerArgs(model_path=checkpoint)
    check_for_linear_attention(args, cfg.linear_layers, cfg.family)
    assert args.disable_radix_cache
