"""Presets of the random-checkpoint tool: config shape and generation knobs per preset.

A preset's config.json is its family's base config (``random_model_families``, chosen by the
preset's ``model_type``; qwen3_moe when absent) updated with the preset's keys. Generation
knobs are not written to config.json.
"""

from __future__ import annotations

from typing import Any

from sgl_jax.tools.train_tokenizer import VOCAB_SIZE

# Small widths shared by every preset: hidden 64, 4 heads.
_SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
}
_SMALL_GQA = {**_SMALL, "num_key_value_heads": 2, "head_dim": 16}
# MLA at small widths (DeepSeek-V3's structure: q and kv LoRA, 2:1 nope:rope, v = nope).
_SMALL_MLA = {
    **_SMALL,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # YaRN as DeepSeek-V3 uses it, at a small scale (factor 4 over 1024 positions).
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
    },
    # Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8) with a tiny hidden size,
    # so routing-heavy benchmarks run on a CPU.
    "qwen3-30b-a3b-routing": {
        "num_hidden_layers": 48,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
    },
    # ---- one tiny checkpoint per further family (4 layers, CPU-test sized) ----------------
    "tiny-qwen2-moe": {
        "model_type": "qwen2_moe",
        **{k: v for k, v in _SMALL_GQA.items() if k != "head_dim"},  # head_dim = 64 / 4
        "num_hidden_layers": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "intermediate_size": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    "tiny-mixtral": {
        "model_type": "mixtral",
        **{k: v for k, v in _SMALL_GQA.items() if k != "head_dim"},
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,  # each expert's width
    },
    "tiny-deepseek-v3": {
        "model_type": "deepseek_v3",
        **_SMALL_MLA,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
    },
    "tiny-glm4-moe": {
        "model_type": "glm4_moe",
        **_SMALL_GQA,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
    },
    "tiny-minimax-m2": {
        "model_type": "minimax_m2",
        **_SMALL_GQA,
        "num_hidden_layers": 4,
        "attn_type_list": [1, 1, 1, 1],
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "intermediate_size": 32,  # each expert's width
        "rotary_dim": 8,  # half of head_dim 16 (the release: 64 of 128)
    },
    # Qwen3.5-MoE at small widths: three Gated DeltaNet layers then one gated-attention layer
    # (the release's pattern, written out: layer_types is what the readers follow), 2 key and 4
    # value heads in the linear layers, partial rotary 0.25 (4 of head_dim 16).
    "tiny-qwen3.5-moe": {
        "model_type": "qwen3_5_moe_text",
        **_SMALL_GQA,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    # gpt-oss at small widths: the release's alternating layers and YaRN (factor 4 over 1024
    # positions, not truncated), a window of 16 (prompts of the tests are longer), and a
    # swiglu_limit of 2.5 rather than 7 so the clamps act on these ~N(0, 1) activations.
    "tiny-gpt-oss": {
        "model_type": "gpt_oss",
        **_SMALL_GQA,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 16,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "intermediate_size": 32,
        "swiglu_limit": 2.5,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 1024,
        },
    },
    # ---- released models' routing shapes at small widths --------------------------------
    "deepseek-v3-routing": {
        "model_type": "deepseek_v3",
        **_SMALL_MLA,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
    },
    "mixtral-8x7b-routing": {
        "model_type": "mixtral",
        **{k: v for k, v in _SMALL_GQA.items() if k != "head_dim"},
        "num_hidden_layers": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    "qwen2-57b-a14b-routing": {
        "model_type": "qwen2_moe",
        **{k: v for k, v in _SMALL_GQA.items() if k != "head_dim"},
        "num_hidden_layers": 28,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 256,  # 8x an expert, as in Qwen2-57B-A14B
        "intermediate_size": 128,
        "norm_topk_prob": False,
    },
    "glm-4.5-air-routing": {
        "model_type": "glm4_moe",
        **_SMALL_GQA,
        "num_hidden_layers": 46,
        "first_k_dense_replace": 1,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "moe_intermediate_size": 32,
        "intermediate_size": 128,
    },
}

# Generation knobs per preset.
#
# Softmax routers (qwen3, qwen2: selection by logit order): the tiny model (4 layers, 16
# experts, top-4; float32-vs-float64 router logit error ~2e-5 at router_std 5) reaches a gap of
# 1e-3 (50x that error) in ~15 draws of ~0.15 s; 2e-3 would take ~50.
# Mixtral (top-2 of 8 logits) has wider gaps at the top: 2e-3 (100x) takes ~2 draws a layer.
#
# Sigmoid routers (deepseek_v3, glm4_moe) select on c = sigmoid(logit) + bias, which compresses
# a logit gap g to ~s(1-s) g: the score gaps among the top 5 of 16 peak near router_std 1
# (s ~ 0.85 at the top, s(1-s) ~ 0.13), where a layer's smallest gap over ~520 tokens has a
# median ~2-3e-5 (simulated); larger router_std saturates the scores and shrinks the gaps. The
# float32 error of c is s(1-s) times the logit error (~4e-6 at router_std 1) plus the rounding
# of s and of the bias add (~1e-7): ~6e-7. Threshold 4e-5 (> 60x) clears in ~3-5 draws a layer;
# 2.5e-4 would be out of reach (< 1% of draws).
#
# The routing-shaped presets cannot be made exact (the many consecutive top-(k+1) gaps of a few
# hundred tokens x tens of layers always hold some ~1e-5 or less): threshold 0, they only
# measure, like qwen3-30b-a3b-routing (48 layers, float32 router error ~3e-4 by the last layer).
_SOFTMAX = {"router_std": 5.0, "logit_std": 3.0}
_SIGMOID = {"router_std": 1.0, "score_bias_std": 0.01, "logit_std": 3.0}
_SEARCH_OFF = {"min_router_gap": 0.0, "max_router_attempts": 1}

GEN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {**_SOFTMAX, "min_router_gap": 1e-3, "max_router_attempts": 64},
    "qwen3-30b-a3b-routing": {**_SOFTMAX, **_SEARCH_OFF},
    "tiny-qwen2-moe": {**_SOFTMAX, "min_router_gap": 1e-3, "max_router_attempts": 64},
    "tiny-mixtral": {**_SOFTMAX, "min_router_gap": 2e-3, "max_router_attempts": 64},
    "tiny-deepseek-v3": {**_SIGMOID, "min_router_gap": 4e-5, "max_router_attempts": 64},
    "tiny-glm4-moe": {**_SIGMOID, "min_router_gap": 4e-5, "max_router_attempts": 64},
    "tiny-minimax-m2": {**_SIGMOID, "min_router_gap": 4e-5, "max_router_attempts": 64},
    "tiny-gpt-oss": {**_SOFTMAX, "min_router_gap": 1e-3, "max_router_attempts": 64},
    "tiny-qwen3.5-moe": {**_SOFTMAX, "min_router_gap": 1e-3, "max_router_attempts": 64},
    "deepseek-v3-routing": {**_SIGMOID, **_SEARCH_OFF},
    "mixtral-8x7b-routing": {**_SOFTMAX, **_SEARCH_OFF},
    "qwen2-57b-a14b-routing": {**_SOFTMAX, **_SEARCH_OFF},
    "glm-4.5-air-routing": {**_SIGMOID, **_SEARCH_OFF},
}
