"""Checkpoint loading: round trip through the tool and the loader, and clear errors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.model_executor.model_runner import make_mesh
from sgl_jax.srt.model_loader.loader import CheckpointError, load_model
from sgl_jax.tools.make_random_model import write_random_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt"))
    write_random_model(path, "tiny", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, seed=3)
    return path


def load(path: str, dtype=jnp.float32):
    return load_model(ModelConfig.from_hf(path), make_mesh(jax.devices(), 1, 1), dtype)


def test_round_trip_every_tensor_equal(ckpt):
    model = load(ckpt)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    layer = params[("model", "layers", 0, "mlp", "w_gate")][...]
    for e in range(layer.shape[0]):
        np.testing.assert_array_equal(
            np.asarray(layer[e]), tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"].T
        )
    np.testing.assert_array_equal(
        np.asarray(params[("model", "layers", 1, "mlp", "down_proj")][...]),
        tensors["model.layers.1.mlp.down_proj.weight"].T,
    )
    np.testing.assert_array_equal(
        np.asarray(params[("model", "embed_tokens")][...]), tensors["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(
        np.asarray(params[("lm_head",)][...]), tensors["lm_head.weight"].T
    )
    # every checkpoint tensor was consumed: count elements on both sides
    assert sum(t.size for t in tensors.values()) == sum(
        np.asarray(v[...]).size for v in params.values()
    )


def test_bfloat16_keeps_router_float32(ckpt):
    model = load(ckpt, jnp.bfloat16)
    assert model.model.layers[0].mlp.gate.weight[...].dtype == jnp.float32
    assert model.model.layers[0].mlp.w_up[...].dtype == jnp.bfloat16


def _rewrite(src: str, dst: str, edit) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor(ckpt, tmp_path):
    bad = _rewrite(ckpt, str(tmp_path / "m"), lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*experts\.5\.up_proj"):
        load(bad)


def test_unexpected_tensor(ckpt, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)

    with pytest.raises(CheckpointError, match=r"unexpected.*mlp\.extra"):
        load(_rewrite(ckpt, str(tmp_path / "u"), add))


def test_misshaped_tensor(ckpt, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][:8]

    with pytest.raises(CheckpointError, match=r"q_proj.*shape \(8, 64\)"):
        load(_rewrite(ckpt, str(tmp_path / "s"), shrink))


def test_corrupted_file(ckpt, tmp_path):
    bad = _rewrite(ckpt, str(tmp_path / "c"), lambda t: None)
    with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="cannot read"):
        load(bad)


def test_unsupported_architecture(ckpt, tmp_path):
    bad = _rewrite(ckpt, str(tmp_path / "a"), lambda t: None)
    cfg_file = os.path.join(bad, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["architectures"] = ["LlamaForCausalLM"]
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ValueError, match="unsupported architecture.*supported: Qwen3MoeForCausalLM"):
        ModelConfig.from_hf(bad)


def test_not_a_directory():
    with pytest.raises(ValueError, match="not a directory"):
        ModelConfig.from_hf("/nonexistent/model")


def test_dense_layers_follow_config(ckpt):
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.moe_layers == (True, False, True)
