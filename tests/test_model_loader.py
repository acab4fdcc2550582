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
from sgl_jax.srt.distributed import make_mesh
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
    with pytest.raises(ValueError, match="unsupported architecture.*supported: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM"):
        ModelConfig.from_hf(bad)


def test_not_a_directory():
    with pytest.raises(ValueError, match="not a directory"):
        ModelConfig.from_hf("/nonexistent/model")


def test_dense_layers_follow_config(ckpt):
    cfg = ModelConfig.from_hf(ckpt)
    assert cfg.moe_layers == (True, False, True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("deepseek"))
    write_random_model(path, "tiny-deepseek-v3", check_routing=False)
    return path


def _edit_config(path: str, edit) -> None:
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)


def test_quantised_checkpoint_is_refused_with_the_supported_list(deepseek, tmp_path):
    bad = _rewrite(deepseek, str(tmp_path / "q"), lambda t: None)
    _edit_config(bad, lambda c: c.update(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match=r"quantised.*'fp8'.*DeepseekV3ForCausalLM"):
        ModelConfig.from_hf(bad)


def test_unsupported_router_variant_is_named(deepseek, tmp_path):
    bad = _rewrite(deepseek, str(tmp_path / "r"), lambda t: None)
    _edit_config(bad, lambda c: c.update(topk_method="greedy", scoring_func="softmax"))
    with pytest.raises(ValueError, match=r"topk_method='greedy'.*supports topk_method='noaux_tc'"):
        ModelConfig.from_hf(bad)


def test_mtp_layers_past_num_hidden_layers_are_ignored(deepseek, tmp_path):
    """Released DeepSeek-V3 / GLM-4.5 checkpoints carry their multi-token-prediction layer as
    model.layers.<num_hidden_layers>.*; loading skips it, and the weights are unchanged."""
    layers = ModelConfig.from_hf(deepseek).num_hidden_layers

    def add_mtp(t):
        for name in [n for n in t if n.startswith("model.layers.1.")]:
            t[name.replace("model.layers.1.", f"model.layers.{layers}.")] = t[name]
        t[f"model.layers.{layers}.eh_proj.weight"] = np.zeros((64, 128), np.float32)

    mtp = _rewrite(deepseek, str(tmp_path / "mtp"), add_mtp)
    a = nnx.to_flat_state(nnx.state(load(deepseek), nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(load(mtp), nnx.Param)))
    assert len(a) == len(b)
    for path, var in a:
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(b[path][...]))


def test_family_names_round_trip(deepseek):
    """Parameters whose HF names do not follow from their paths (biases, the correction bias,
    stacked experts) hold exactly the checkpoint's tensors."""
    model = load(deepseek)
    tensors = load_file(os.path.join(deepseek, "model.safetensors"))
    moe = model.model.layers[1].mlp
    np.testing.assert_array_equal(np.asarray(moe.gate.e_score_correction_bias[...]),
                                  tensors["model.layers.1.mlp.gate.e_score_correction_bias"])
    np.testing.assert_array_equal(np.asarray(moe.gate.weight[...]),
                                  tensors["model.layers.1.mlp.gate.weight"].T)
    np.testing.assert_array_equal(np.asarray(moe.shared_experts.down_proj[...]),
                                  tensors["model.layers.1.mlp.shared_experts.down_proj.weight"].T)
    attn = model.model.layers[0].self_attn
    np.testing.assert_array_equal(np.asarray(attn.kv_b_proj[...]),
                                  tensors["model.layers.0.self_attn.kv_b_proj.weight"].T)
