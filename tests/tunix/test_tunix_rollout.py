"""SglJaxRollout against tunix's BaseRollout contract (tunix 0.1.7, the ``tunix`` extra).

The references are independent of the engine: tunix's own Qwen3-MoE model loaded from the
bundled checkpoint (its per-token logprobs, ``tunix.rl.common.compute_per_token_logps``), the
checkpoint file itself (the weight names and layouts) and the bundled tokenizer. Skipped
without tunix (its own CI stage installs it: .ci/run).
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("tunix", reason="needs the tunix extra: pip install 'sgl_jax[tunix]'")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from sgl_jax.integrations.tunix import SglJaxRollout  # noqa: E402
from sgl_jax.integrations.tunix_qwen3 import (  # noqa: E402
    ReplayQwen3,
    hf_arrays_from_tunix_qwen3,
    replayed_per_token_logps,
    tunix_qwen3_config,
)
from sgl_jax.integrations.tunix_qwen3_replay import forced_forward  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH  # noqa: E402
from sgl_jax.srt.tokenizer import Tokenizer  # noqa: E402
from tests.tunix.tunix_utils import (  # noqa: E402
    MAX_NEW,
    TEMPERATURE,
    TOL,
    load_actor,
    make_mesh,
    right_padded,
    rollout_config,
    tunix_logps,
)


@pytest.fixture(scope="module")
def actor():
    return load_actor()


@pytest.fixture(scope="module")
def rollout(actor):
    # The keywords RLCluster passes (tunix/rl/rl_cluster.py, a BaseRollout subclass).
    r = SglJaxRollout(rollout_actor=actor, tokenizer=None, mesh=make_mesh(),
                      rollout_config=rollout_config())
    yield r
    r.shutdown()


# -- the contract -------------------------------------------------------------------------------
def test_every_abstract_method_is_implemented_with_tunixs_signature():
    assert not SglJaxRollout.__abstractmethods__
    for name in base_rollout.BaseRollout.__abstractmethods__:
        ours = inspect.signature(getattr(SglJaxRollout, name)).parameters
        theirs = inspect.signature(getattr(base_rollout.BaseRollout, name)).parameters
        named = [p for p in theirs if theirs[p].kind is not inspect.Parameter.VAR_KEYWORD]
        assert all(p in ours for p in named), (name, list(ours), named)


def test_pad_and_eos_ids_are_the_served_tokenizers(rollout):
    tok = Tokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    assert (rollout.pad_id(), rollout.eos_id()) == (tok.pad_token_id, tok.eos_token_id)
    assert rollout.pad_id() != rollout.eos_id()
    assert rollout.model() is None and rollout.model_state() is None


def test_generate_returns_tunixs_fields_with_logprobs_and_routed_experts(rollout, actor):
    tok = Tokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    prompts = ["The cat sat on", "Once upon a time", "The cat sat on"]
    rollout.take_routed_experts()
    out = rollout.generate(prompts, rollout_config(seed=7))
    pad, eos = rollout.pad_id(), rollout.eos_id()
    left = out.left_padded_prompt_tokens
    assert left.shape == (3, 16) and out.logits is None
    for row, prompt in zip(left, prompts, strict=True):
        ids = tok.encode(prompt)
        assert row[16 - len(ids):].tolist() == ids and (row[:16 - len(ids)] == pad).all()
    for text, tokens, logprobs in zip(out.text, out.tokens, out.logprobs, strict=True):
        assert tokens.dtype == np.int32 and 1 <= len(tokens) <= MAX_NEW
        assert logprobs.shape == tokens.shape and (logprobs <= 0).all()
        assert text == tok.decode(tokens.tolist(), skip_special_tokens=True)
        assert eos not in tokens[:-1].tolist()  # a stop token can only end a sample
    # The same prompt twice in one batch draws its own sample (seed + i, as GRPO needs).
    assert out.tokens[0].tolist() != out.tokens[2].tolist()
    # The engine's logprobs of its own samples are the trainer model's.
    completions = right_padded(out.tokens, MAX_NEW, pad)
    want = tunix_logps(actor, left, completions, pad, eos)
    got = right_padded(out.logprobs, MAX_NEW, 0.0)
    mask = completions != pad
    diff = np.abs(got - want)[mask].max()
    print(f"largest |engine - tunix| logprob of the engine's samples: {diff:.2e}")
    assert diff < TOL
    # Routed experts: one row per token fed to the model, every layer's top-k.
    experts = rollout.take_routed_experts()
    assert rollout.take_routed_experts() == []
    for e, prompt, tokens in zip(experts, prompts, out.tokens, strict=True):
        assert e.shape == (len(tok.encode(prompt)) + len(tokens) - 1, 4, 4)
        assert ((0 <= e) & (e < 16)).all()
    # ... and, on the output, laid out like the batch tunix builds from it: prompt rows
    # against the completion, completion rows from its start, -1 elsewhere (padding and the
    # last generated token, which was never fed to the model).
    aligned = out.routed_experts
    assert aligned.shape == (3, 16 + MAX_NEW, 4, 4) and aligned.dtype == np.int32
    for row, e, tokens in zip(aligned, experts, out.tokens, strict=True):
        n_prompt = len(e) + 1 - len(tokens)
        want = np.full((16 + MAX_NEW, 4, 4), -1)
        want[16 - n_prompt:16] = e[:n_prompt]
        want[16:16 + len(tokens) - 1] = e[n_prompt:]
        np.testing.assert_array_equal(row, want)
    # The trainer under that routing gives the engine's logprobs, through the experts the
    # engine chose at every (token, layer) the engine computed.
    replay = ReplayQwen3.from_model(actor)
    replayed = np.asarray(replayed_per_token_logps(replay, left, completions, aligned,
                                                   pad_id=pad, eos_id=eos,
                                                   temperature=TEMPERATURE))
    assert np.abs(replayed - got)[mask].max() < TOL
    tokens_in, positions, attn_mask, _ = common.process_ids(
        jnp.asarray(left), jnp.asarray(completions), pad, eos)
    _, used = forced_forward(replay, tokens_in, positions, attn_mask, jnp.asarray(aligned))
    replayed_rows = aligned[..., 0] >= 0
    np.testing.assert_array_equal(np.asarray(used)[replayed_rows], aligned[replayed_rows])
    # The same seed again: the same samples.
    again = rollout.generate(prompts, rollout_config(seed=7))
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in out.tokens]


def test_a_prompt_longer_than_max_prompt_length_widens_to_a_power_of_two(rollout):
    long_prompt = "one two three four five six seven eight nine ten eleven twelve thirteen"
    out = rollout.generate([long_prompt, "hi"], rollout_config(max_tokens_to_generate=1))
    n = len(Tokenizer.from_pretrained(BUNDLED_MODEL_PATH).encode(long_prompt))
    assert n > 16
    assert out.left_padded_prompt_tokens.shape == (2, 1 << (n - 1).bit_length())


def test_per_token_logps_equal_the_trainer_models(rollout, actor):
    pad, eos = rollout.pad_id(), rollout.eos_id()
    prompts = np.array([[pad, pad, 300, 12, 45], [7, 8, 9, 10, 11], [pad, pad, pad, 99, 1]])
    completions = np.array([[5, 6, 7, pad], [250, 31, pad, pad], [pad, pad, pad, pad]])
    got = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions)))
    assert got.shape == completions.shape and got.dtype == np.float32
    mask = completions != pad
    assert (got[~mask] == 0).all()  # pads, and the row with no completion at all
    want = tunix_logps(actor, prompts, completions, pad, eos)
    assert np.abs(got - want)[mask].max() < TOL


def test_bad_input_is_a_clear_error(rollout):
    with pytest.raises(TypeError, match="unknown keyword"):
        rollout.generate(["hi"], rollout_config(), echo=True)
    with pytest.raises(ValueError, match="no prompts"):
        rollout.generate([], rollout_config())
    pad = rollout.pad_id()
    with pytest.raises(ValueError, match="only pad tokens"):
        rollout.get_per_token_logps(np.array([[pad, pad]]), np.array([[5, 6]]))
    with pytest.raises(ValueError, match="batch, length"):
        rollout.get_per_token_logps(np.array([1, 2]), np.array([[5, 6]]))


def test_refused_updates_leave_the_served_weights(rollout, actor):
    probe = (np.array([[7, 8, 9]]), np.array([[10, 11]]))
    before = np.asarray(rollout.get_per_token_logps(*probe))
    with pytest.raises(ValueError, match="LoRA"):
        rollout.update_params(nnx.state(actor, nnx.Param), filter_types=(nnx.LoRAParam,))
    bogus = {**nnx.to_pure_dict(nnx.state(actor, nnx.Param)), "adapter": {"w": jnp.zeros(3)}}
    with pytest.raises(ValueError, match="'adapter.w' has no Hugging Face name"):
        rollout.update_params(bogus)
    np.testing.assert_array_equal(np.asarray(rollout.get_per_token_logps(*probe)), before)


# -- the model next to ours ---------------------------------------------------------------------
def test_tunix_weights_map_to_the_checkpoints_names_and_layouts(actor):
    """tunix's loader transposed and stacked the file; the mapping must give the file back."""
    arrays = hf_arrays_from_tunix_qwen3(nnx.state(actor, nnx.Param))
    file = load_file(f"{BUNDLED_MODEL_PATH}/model.safetensors")
    assert set(arrays) == set(file)
    for name, value in file.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), value, err_msg=name)


def test_the_bundled_model_is_one_tunix_can_train():
    cfg = json.load(open(f"{BUNDLED_MODEL_PATH}/config.json"))
    # tunix's Qwen3 always renormalises the top-k and uses rope theta 1e6: the bundled
    # model does both, so trainer and engine compute the same function.
    assert cfg["norm_topk_prob"] is True and cfg["rope_theta"] == 1e6
    t = tunix_qwen3_config()
    assert (t.num_layers, t.embed_dim, t.hidden_dim, t.num_experts, t.num_experts_per_tok) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["moe_intermediate_size"],
        cfg["num_experts"], cfg["num_experts_per_tok"])


def test_a_checkpoint_tunix_would_compute_differently_is_refused(tmp_path):
    shutil.copytree(BUNDLED_MODEL_PATH, tmp_path, dirs_exist_ok=True)
    cfg = json.load(open(tmp_path / "config.json"))
    cfg.update(norm_topk_prob=False, rope_theta=10000.0, mlp_only_layers=[0])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_topk_prob.*rope_theta 10000.*dense"):
        tunix_qwen3_config(str(tmp_path))


def test_engine_settings_bound_with_a_partial_win_over_the_rollout_configs():
    """tunix also takes ``functools.partial(SglJaxRollout, ...)``; without an actor the
    engine serves its checkpoint as loaded (no sync)."""
    make = functools.partial(SglJaxRollout, enable_return_routed_experts=False)
    config = rollout_config()
    config.rollout_sglang_jax_kwargs["enable_return_routed_experts"] = True
    r = make(rollout_actor=None, tokenizer=None, mesh=make_mesh(), rollout_config=config)
    try:
        assert r.engine.server_args.enable_return_routed_experts is False
        assert r.engine.server_args.model_path in (None, BUNDLED_MODEL_PATH)
        out = r.generate(["hi"], rollout_config(max_tokens_to_generate=2))
        assert len(out.tokens[0]) >= 1 and r.take_routed_experts() == []
        assert r.engine.get_server_info()["weight_version"] == "0"
    finally:
        r.shutdown()
