"""Every backend combination on one device (M8): attention native / pallas (TPU kernel in
interpret mode on CPU) x MoE dense / ragged x page size 1 / 16.

Each runs the scenario of tests/backend_scenario.py (chunked prefill, a cached prefix of whole
pages, a mixed extend batch, decode) against the independent float64 reference forward:
routed experts exactly, logits to 1e-5 relative, after every bucket was compiled: the
scenario must not compile anything more. Multi-device layouts with these backends are in
tests/test_parallel.py.

The Pallas kernel needs head_dim to be a multiple of 128, so its combinations run on a random
checkpoint of the tiny shape with head_dim 128 (the bundled model has 16).
"""

from __future__ import annotations

import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.model_runner import ModelRunner
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.testing import TEST_MODEL_PATH
from sgl_jax.tools.make_random_model import write_random_model
from tests.backend_scenario import assert_matches, reference_scenario, run_scenario

REL_TOL = 1e-5
HEAD128 = "head128"

# (model, attention backend, moe backend, page size)
COMBINATIONS = [
    (TEST_MODEL_PATH, "native", "dense", 1),
    (TEST_MODEL_PATH, "native", "ragged", 1),
    (TEST_MODEL_PATH, "native", "dense", 16),
    (TEST_MODEL_PATH, "native", "ragged", 16),
    (HEAD128, "native", "ragged", 16),
    (HEAD128, "pallas", "dense", 1),
    (HEAD128, "pallas", "ragged", 1),
    (HEAD128, "pallas", "dense", 16),
    (HEAD128, "pallas", "ragged", 16),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    path = str(tmp_path_factory.mktemp("models") / HEAD128)
    write_random_model(path, "tiny", {"head_dim": 128}, seed=5)
    return {TEST_MODEL_PATH: TEST_MODEL_PATH, HEAD128: path}


@pytest.fixture(scope="module")
def references(models) -> dict[str, dict]:
    return {name: reference_scenario(path) for name, path in models.items()}


def _id(combo: tuple) -> str:
    model, attention, moe, page = combo
    return f"{'tiny' if model == TEST_MODEL_PATH else model}-{attention}-{moe}-p{page}"


@pytest.mark.parametrize("combo", COMBINATIONS, ids=[_id(c) for c in COMBINATIONS])
def test_backend_matches_reference(models, references, combo):
    model, attention, moe, page = combo
    args = ServerArgs(
        model_path=models[model], attention_backend=attention, moe_backend=moe, page_size=page,
        max_running_requests=4, chunked_prefill_size=32, precompile_token_paddings=[32],
        precompile_bs_paddings=[4], max_total_tokens=512, attention_block_size=16,
        context_length=256, enable_return_routed_experts=True,
    )
    runner = ModelRunner(args, ModelConfig.from_hf(models[model], args.context_length))
    assert runner.backends.attention.name == attention and runner.backends.moe.name == moe
    runner.precompile()
    compiled = runner.num_compiles
    assert_matches(run_scenario(runner), references[model], REL_TOL)
    assert runner.num_compiles == compiled


def test_pallas_rejects_small_head_dim():
    args = ServerArgs(attention_backend="pallas")
    with pytest.raises(ValueError, match="head_dim to be a multiple of 128"):
        ModelRunner(args, ModelConfig.from_hf(TEST_MODEL_PATH))


def test_dtype_auto_and_backend_auto_by_platform():
    import jax.numpy as jnp

    from sgl_jax.srt.layers.moe.experts import resolve_moe_backend
    from sgl_jax.srt.model_executor.model_runner import resolve_dtype

    assert resolve_dtype("auto", "cpu") == jnp.float32
    assert resolve_dtype("auto", "tpu") == jnp.bfloat16
    assert resolve_dtype("auto", "gpu") == jnp.bfloat16
    assert resolve_dtype("float32", "tpu") == jnp.float32
    assert resolve_moe_backend("auto", "tpu") == "gmm"
    assert resolve_moe_backend("auto", "cpu") == "dense"
    assert resolve_moe_backend("ragged", "cpu") == "ragged"
