"""Qwen3.5-MoE's config.json in both forms: the released vision-language
``Qwen3_5MoeForConditionalGeneration`` (language fields under ``text_config``) and the flat
text-only ``Qwen3_5MoeForCausalLM``. Field names and defaults are transformers 5.23's
(``configuration_qwen3_5_moe.py``); ``layer_types`` is read, not assumed."""

from __future__ import annotations

import dataclasses

import pytest

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.distributed import parallel_layout_errors
from sgl_jax.srt.models.registry import get_model_class

TEXT = dict(
    model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    max_position_embeddings=256, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, eos_token_id=1, bos_token_id=None, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    mtp_num_hidden_layers=1,
)


def flat(**over) -> dict:
    return {"architectures": ["Qwen3_5MoeForCausalLM"], **TEXT, **over}


def nested(**over) -> dict:
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": {**TEXT, **over}, "vision_config": {"depth": 2, "hidden_size": 32},
            "image_token_id": 500, "tie_word_embeddings": False}


def test_both_forms_read_the_same_text_model():
    a, b = ModelConfig.from_dict(flat(), "/m"), ModelConfig.from_dict(nested(), "/m")
    assert dataclasses.replace(b, architecture=a.architecture) == a
    assert a.family == "qwen3_5_moe" and a.router == "softmax_topk" and a.norm_topk_prob
    assert a.linear_layers == (True, False, True, False)  # as listed, not "every 4th"
    assert a.moe_layers == (True,) * 4
    assert (a.num_shared_experts, a.shared_expert_intermediate_size, a.shared_expert_gated) == (
        1, 48, True)
    assert a.rotary_dim == 8 and a.rope_theta == 1e7 and a.head_dim == 32
    assert a.norm_plus_one and a.attn_output_gate and a.qk_norm
    assert (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
            a.linear_value_head_dim, a.linear_conv_kernel_dim) == (2, 4, 16, 8, 4)
    assert a.linear_conv_dim == 2 * 2 * 16 + 4 * 8
    assert a.mtp_num_hidden_layers == 1 and a.eos_token_ids == (1,)


def test_full_attention_interval_when_layer_types_absent():
    cfg = flat(layer_types=None, num_hidden_layers=6, full_attention_interval=3)
    assert ModelConfig.from_dict(cfg, "/m").linear_layers == (True, True, False) * 2
    cfg = flat(layer_types=None, num_hidden_layers=8)  # transformers' default interval: 4
    assert ModelConfig.from_dict(cfg, "/m").linear_layers == (True, True, True, False) * 2


def test_partial_rotary_at_the_top_level_and_default():
    assert ModelConfig.from_dict(flat(partial_rotary_factor=0.5), "/m").rotary_dim == 16
    rope = {"rope_type": "default", "rope_theta": 1e6}
    assert ModelConfig.from_dict(flat(rope_parameters=rope), "/m").rotary_dim == 8


@pytest.mark.parametrize("over, needle", [
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must list 4"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
])
def test_bad_fields_are_named(over, needle):
    for make, where in ((flat, ""), (nested, "text_config.")):
        with pytest.raises(ValueError, match="config.json: " + where) as e:
            ModelConfig.from_dict(make(**over), "/m")
        assert needle in str(e.value)


def test_nested_form_needs_text_config():
    cfg = nested()
    del cfg["text_config"]
    with pytest.raises(ValueError, match="needs a text_config object"):
        ModelConfig.from_dict(cfg, "/m")


def test_both_forms_have_a_model_class():
    """Served since the Gated DeltaNet states are in the step (tests/test_qwen35_engine.py)."""
    for arch in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        assert get_model_class(arch).__name__ == arch


def test_tiny_preset_reads(tmp_path):
    """make_random_model's tiny-qwen3.5-moe: the config reads, and the float64 reference runs
    it (transformers loads it too: test_hf_qwen35)."""
    from sgl_jax.tools.make_random_model import write_random_model
    from sgl_jax.tools.reference_qwen35 import Qwen35Reference

    write_random_model(str(tmp_path), "tiny-qwen3.5-moe", check_routing=False)
    cfg = ModelConfig.from_hf(str(tmp_path))
    assert cfg.linear_layers == (True, True, True, False) and cfg.rotary_dim == 4
    out = Qwen35Reference(str(tmp_path)).forward([5, 6, 7, 8, 9])
    assert out.topk_ids.shape == (5, 4, 4) and out.logits.shape == (5, cfg.vocab_size)


def test_tp_must_split_the_linear_key_heads():
    """The Gated DeltaNet layers split by key head over "tensor": a tp that does not divide
    linear_num_key_heads is refused by name (here 3 key heads; the other dims divide by 3)."""
    cfg = ModelConfig.from_dict(flat(linear_num_key_heads=3, linear_num_value_heads=6,
                                     num_attention_heads=3, num_key_value_heads=3,
                                     moe_intermediate_size=48, vocab_size=513), "/m")
    assert parallel_layout_errors(cfg, 3, 1, 4) == []
    errors = parallel_layout_errors(cfg, 2, 1, 4)
    assert any("linear_num_key_heads=3" in e for e in errors), errors
