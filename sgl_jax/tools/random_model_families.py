"""Model families of the random-checkpoint tool: config.json shape, checks and HF tensors.

One :class:`Family` per Hugging Face architecture (see ``make_random_model`` for how the
weights are scaled and seeded). Tensor names and shapes are exactly Hugging Face's:

- qwen3_moe (Qwen3MoeForCausalLM): GQA with q_norm/k_norm, ``mlp.gate`` + ``mlp.experts.{e}``.
- qwen2_moe (Qwen2MoeForCausalLM): GQA with q/k/v biases, plus a gated shared expert
  (``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight`` [1, H]).
- mixtral (MixtralForCausalLM): ``block_sparse_moe.gate`` + ``block_sparse_moe.experts.{e}.w1/w3``
  (gate/up [I, H]) and ``w2`` (down [H, I]); every layer MoE.
- deepseek_v3 (DeepseekV3ForCausalLM): MLA attention, sigmoid router with
  ``mlp.gate.e_score_correction_bias`` [E], ungated ``mlp.shared_experts.*``; the first
  ``first_k_dense_replace`` layers (and those off ``moe_layer_freq``) dense.
- glm4_moe (Glm4MoeForCausalLM): GQA with optional q/k/v biases and q/k norms, partial rotary,
  the DeepSeek-V3 router and shared experts; the first ``first_k_dense_replace`` layers dense.
- minimax_m2 (MiniMaxM2ForCausalLM): GQA with per-layer q/k norms (``q_norm`` [heads * D],
  ``k_norm`` [kv_heads * D]), partial rotary (``rotary_dim``), ``block_sparse_moe.gate`` and
  ``block_sparse_moe.e_score_correction_bias`` [E] (on the block), experts ``w1/w3/w2`` as
  Mixtral; every layer MoE.
- gpt_oss (GptOssForCausalLM): GQA with q/k/v/o biases and ``sinks`` [heads], sliding-window
  layers by ``layer_types``; ``mlp.router`` (weight and bias); fused experts
  ``mlp.experts.gate_up_proj`` [E, H, 2I] (gate even columns, up odd), ``gate_up_proj_bias``
  [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]; every layer MoE. With
  ``quantization_config`` ``{"quant_method": "mxfp4"}`` the two expert weights are written as
  MXFP4 (``*_blocks`` [E, out, in / 32, 16] uint8, ``*_scales`` [E, out, in / 32] uint8):
  random E2M1 codes and per-block exponents, whose values are the model's weights.

- qwen3_5_moe_text (Qwen3_5MoeForCausalLM, the text-only form of Qwen3.5-MoE): ``layer_types``
  says per layer Gated DeltaNet (``linear_attn.in_proj_qkv/in_proj_z/in_proj_b/in_proj_a``,
  ``conv1d.weight`` [conv_dim, 1, K], ``dt_bias``, ``A_log``, ``norm`` [dv], ``out_proj``) or
  gated attention (``q_proj`` [heads * 2D, H]: per head query then gate; q/k norms);
  every layer MoE with per-expert ``mlp.experts.{e}`` (the layout transformers' save_pretrained
  writes) and a gated shared expert. Its RMSNorms compute x * (1 + w): their weights are drawn
  around 0, not 1.

DeepSeek-V3 and GLM-4.5 also ship ``num_nextn_predict_layers`` multi-token-prediction (MTP)
layers after the decoder layers (``mtp_weights``; default 1, ``--set num_nextn_predict_layers=0``
writes none): the draft of NEXTN speculative decoding (see ``reference_nextn``). Qwen3.5-MoE
ships ``mtp_num_hidden_layers`` (default 1, as released) under ``mtp.*`` (``qwen3_5_mtp_weights``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Tensors = dict[str, np.ndarray]


def rng(seed: int, name: str, attempt: int | None = None) -> np.random.Generator:
    """The generator of one tensor: seeded by (seed, crc32(name)[, router attempt])."""
    key = [seed, zlib.crc32(name.encode())]
    return np.random.default_rng(key if attempt is None else key + [attempt])


def normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng(seed, name).standard_normal(shape) * std).astype(np.float32)


def norm_weight(seed: int, name: str, size: int) -> np.ndarray:
    return (1.0 + 0.1 * rng(seed, name).standard_normal(size)).astype(np.float32)


# Biases (q/k/v projections) are N(0, BIAS_STD^2): small next to the O(1) projections, but
# large enough that a kernel dropping them is caught.
BIAS_STD = 0.1


# --------------------------------------------------------------------------------------------
# Base configs: every key transformers' config class reads, with the family's released values
# (the preset then sets the shape). torch_dtype float32: random checkpoints are exact.
# --------------------------------------------------------------------------------------------

QWEN3_MOE_BASE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
}

# Qwen2-57B-A14B's values (transformers' Qwen2MoeConfig keys).
QWEN2_MOE_BASE: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_window_layers": 28,
    "mlp_only_layers": [],
    "norm_topk_prob": False,
    "output_router_logits": False,
    "qkv_bias": True,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
}

# Mixtral-8x7B-v0.1's values (transformers' MixtralConfig keys; head_dim = hidden / heads).
MIXTRAL_BASE: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "output_router_logits": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
}

# DeepSeek-V3's released values (no quantization_config, no auto_map), including its one
# multi-token-prediction (MTP) layer: num_nextn_predict_layers 1 (see mtp_weights).
DEEPSEEK_V3_BASE: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "float32",
    "use_cache": True,
}

# GLM-4.5-Air's released values (one MTP layer, as DeepSeek-V3).
GLM4_MOE_BASE: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "n_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_qk_norm": False,
}


# MiniMax-M2's released values (without its fp8 quantization_config and MTP modules).
MINIMAX_M2_BASE: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attention_dropout": 0.0,
    "attn_type_list": None,  # set per preset: every layer full attention (1)
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "output_router_logits": False,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
}

# Qwen3.5-35B-A3B's language-model values (its text_config), in the flat text-only form.
QWEN3_5_MOE_BASE: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "mtp_num_hidden_layers": 1,  # mtp.* (qwen3_5_mtp_weights): NEXTN's draft
}

# gpt-oss-120b's values (unquantised: no quantization_config unless a preset asks for MXFP4).
GPT_OSS_BASE: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "output_router_logits": False,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096,
    },
    "rope_theta": 150000.0,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
}

# --------------------------------------------------------------------------------------------
# Per-family rules
# --------------------------------------------------------------------------------------------


def _qwen_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """Qwen-MoE's rule: a layer has a router unless listed dense or off the sparse step."""
    return (
        layer not in set(config["mlp_only_layers"])
        and config["num_experts"] > 0
        and (layer + 1) % config["decoder_sparse_step"] == 0
    )


def _deepseek_moe_layer(config: dict[str, Any], layer: int) -> bool:
    freq = int(config.get("moe_layer_freq", 1) or 1)
    return (
        config["n_routed_experts"] > 0
        and layer >= config["first_k_dense_replace"]
        and layer % freq == 0
    )


def _glm_moe_layer(config: dict[str, Any], layer: int) -> bool:
    return config["n_routed_experts"] > 0 and layer >= config["first_k_dense_replace"]


@dataclass(frozen=True)
class Family:
    """What differs between model families (HF architecture -> tensors and rules)."""

    model_type: str
    base_config: dict[str, Any]
    experts_key: str  # config key of the routed-expert count
    router_rule: str  # softmax_topk | topk_softmax | sigmoid_grouped (spec's router rules)
    is_moe_layer: Callable[[dict[str, Any], int], bool]
    mlp_prefix: str = "mlp"  # module of a MoE layer's router and experts
    router_module: str = "gate"  # the router's module in it (gpt-oss: "router")
    # Where a sigmoid router's e_score_correction_bias lives under the MoE block.
    score_bias: str = "gate.e_score_correction_bias"

    def num_experts(self, config: dict[str, Any]) -> int:
        return int(config[self.experts_key])

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.mlp_prefix}.{self.router_module}.weight"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", QWEN3_MOE_BASE, "num_experts", "softmax_topk", _qwen_moe_layer),
        Family("qwen2_moe", QWEN2_MOE_BASE, "num_experts", "softmax_topk", _qwen_moe_layer),
        Family(
            "mixtral",
            MIXTRAL_BASE,
            "num_local_experts",
            "topk_softmax",
            lambda c, i: c["num_local_experts"] > 0,
            mlp_prefix="block_sparse_moe",
        ),
        Family(
            "deepseek_v3",
            DEEPSEEK_V3_BASE,
            "n_routed_experts",
            "sigmoid_grouped",
            _deepseek_moe_layer,
        ),
        Family("glm4_moe", GLM4_MOE_BASE, "n_routed_experts", "sigmoid_grouped", _glm_moe_layer),
        Family("minimax_m2", MINIMAX_M2_BASE, "num_local_experts", "sigmoid_grouped",
               lambda c, i: c["num_local_experts"] > 0, mlp_prefix="block_sparse_moe",
               score_bias="e_score_correction_bias"),
        Family("qwen3_5_moe_text", QWEN3_5_MOE_BASE, "num_experts", "softmax_topk",
               lambda c, i: c["num_experts"] > 0),
        Family("gpt_oss", GPT_OSS_BASE, "num_local_experts", "topk_softmax",
               lambda c, i: c["num_local_experts"] > 0, router_module="router"),
    )
}


def family_of(config: dict[str, Any]) -> Family:
    model_type = config.get("model_type", "qwen3_moe")
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def head_dim(config: dict[str, Any]) -> int:
    """GQA head width: head_dim when set, else hidden_size / num_attention_heads."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rotary_dim(config: dict[str, Any]) -> int:
    """Dims of a q/k head RoPE rotates (GLM's partial rotary; MLA: qk_rope_head_dim)."""
    if config["model_type"] == "deepseek_v3":
        return int(config["qk_rope_head_dim"])
    if config["model_type"] == "glm4_moe":
        return int(head_dim(config) * config.get("partial_rotary_factor", 0.5))
    if config["model_type"] == "minimax_m2":
        return int(config.get("rotary_dim") or head_dim(config))
    if config["model_type"] == "qwen3_5_moe_text":
        return int(head_dim(config) * config["rope_parameters"]["partial_rotary_factor"])
    return head_dim(config)


def check_config(config: dict[str, Any], vocab_min: int, dtypes: tuple[str, ...]) -> None:
    """Raise ValueError naming the field when a config cannot describe a valid checkpoint."""
    fam = family_of(config)
    n_layers = config["num_hidden_layers"]
    experts = fam.num_experts(config)
    if config["vocab_size"] < vocab_min:
        raise ValueError(f"vocab_size={config['vocab_size']} < tokenizer size {vocab_min}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if not 1 <= config["num_experts_per_tok"] <= max(experts, 1):
        raise ValueError(f"num_experts_per_tok must be in [1, {fam.experts_key}]")
    if config["torch_dtype"] not in dtypes:
        raise ValueError(f"torch_dtype must be one of {dtypes}")
    if fam.model_type in ("qwen3_moe", "qwen2_moe"):
        if config["decoder_sparse_step"] < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        if any(not 0 <= i < n_layers for i in config["mlp_only_layers"]):
            raise ValueError(f"mlp_only_layers {config['mlp_only_layers']} outside [0, {n_layers})")
    if fam.model_type in ("deepseek_v3", "glm4_moe"):
        if not 0 <= config["first_k_dense_replace"] <= n_layers:
            raise ValueError(f"first_k_dense_replace must be in [0, {n_layers}]")
        if int(config.get("moe_layer_freq", 1) or 1) < 1:
            raise ValueError("moe_layer_freq must be >= 1")
        n_group, topk_group = config["n_group"], config["topk_group"]
        if n_group < 1 or experts % n_group or experts // n_group < 2:
            raise ValueError("n_group must divide the experts into groups of >= 2")
        if not 1 <= topk_group <= n_group:
            raise ValueError("topk_group must be in [1, n_group]")
        if config["num_experts_per_tok"] > topk_group * (experts // n_group):
            raise ValueError("num_experts_per_tok exceeds the experts of the kept groups")
    if fam.model_type == "deepseek_v3":
        if config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError("topk_method must be 'noaux_tc'")
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("scoring_func must be 'sigmoid'")
        if config["q_lora_rank"] is not None and config["q_lora_rank"] < 1:
            raise ValueError("q_lora_rank must be null or >= 1")
        if config["num_key_value_heads"] != config["num_attention_heads"]:
            raise ValueError("MLA: num_key_value_heads must equal num_attention_heads")
    if num_mtp_layers(config) < 0 or (
        num_mtp_layers(config) and fam.model_type not in ("deepseek_v3", "glm4_moe")
    ):
        raise ValueError("num_nextn_predict_layers: >= 0, and only DeepSeek-V3 / GLM-4.5 have any")
    if fam.model_type == "gpt_oss":
        types = config.get("layer_types") or []
        if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError("layer_types must give each layer 'sliding_attention' or "
                             "'full_attention'")
        if is_mxfp4(config) and (config["hidden_size"] % 32 or config["intermediate_size"] % 32):
            raise ValueError("MXFP4 packs blocks of 32: hidden_size and intermediate_size "
                             "must be multiples of 32")
    if fam.model_type == "qwen3_5_moe_text":
        types = config.get("layer_types") or []
        if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError("layer_types must give each layer 'linear_attention' or "
                             "'full_attention'")
        if config["linear_num_value_heads"] % config["linear_num_key_heads"]:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if fam.model_type == "minimax_m2" and rotary_dim(config) > head_dim(config):
        raise ValueError("rotary_dim must be <= head_dim")
    if rotary_dim(config) % 2 or rotary_dim(config) < 2:
        raise ValueError("the rotary dims of a head must be even (RoPE rotates pairs)")


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


class _Writer:
    """Collects tensors, each drawn from its own seed (see make_random_model)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.w: Tensors = {}

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.w[name] = normal(self.seed, name, shape, std)

    def linear(self, name: str, out_features: int, in_features: int) -> None:
        """[out, in] with std 1/sqrt(in): O(1) inputs give O(1) outputs."""
        self.normal(name, (out_features, in_features), 1 / np.sqrt(in_features))

    def norm(self, name: str, size: int) -> None:
        self.w[name] = norm_weight(self.seed, name, size)


def is_mxfp4(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def _gqa_attention(wr: _Writer, config: dict[str, Any], p: str, bias: bool, qk_norm: bool,
                   layer_qk_norm: bool = False, o_bias: bool = False, sinks: bool = False) -> None:
    h, hd = config["hidden_size"], head_dim(config)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    a = p + "self_attn."
    wr.linear(a + "q_proj.weight", heads * hd, h)
    wr.linear(a + "k_proj.weight", kv_heads * hd, h)
    wr.linear(a + "v_proj.weight", kv_heads * hd, h)
    wr.linear(a + "o_proj.weight", h, heads * hd)
    if bias:
        wr.normal(a + "q_proj.bias", (heads * hd,), BIAS_STD)
        wr.normal(a + "k_proj.bias", (kv_heads * hd,), BIAS_STD)
        wr.normal(a + "v_proj.bias", (kv_heads * hd,), BIAS_STD)
    if qk_norm:
        wr.norm(a + "q_norm.weight", hd)
        wr.norm(a + "k_norm.weight", hd)
    if layer_qk_norm:  # MiniMax-M2: one norm over all heads
        wr.norm(a + "q_norm.weight", heads * hd)
        wr.norm(a + "k_norm.weight", kv_heads * hd)
    if o_bias:
        wr.normal(a + "o_proj.bias", (h,), BIAS_STD)
    if sinks:  # logits of the order of the attention scores
        wr.normal(a + "sinks", (heads,), 1.0)


def _gpt_oss_experts(wr: _Writer, config: dict[str, Any], p: str) -> None:
    """Fused float experts, or MXFP4 blocks and scales of the same [E, out, in] matrices."""
    h, inter, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    x = p + "mlp.experts."
    for name, rows, cols in (("gate_up_proj", h, 2 * inter), ("down_proj", inter, h)):
        if is_mxfp4(config):
            # Codes uniform over the 16 E2M1 values (rms 2.93) and block exponents 2^(j - k),
            # j in {0, 1} (rms 1.58), k = log2(4.6 sqrt(fan_in)): weights of rms
            # ~1/sqrt(fan_in), so activations keep their scale through the layers.
            g = rng(wr.seed, x + name)
            wr.w[x + name + "_blocks"] = g.integers(0, 256, (e, cols, rows // 32, 16),
                                                    dtype=np.uint8)
            k = int(round(np.log2(4.6 * np.sqrt(rows))))
            wr.w[x + name + "_scales"] = (127 - k + g.integers(0, 2, (e, cols, rows // 32))
                                          ).astype(np.uint8)
        else:
            wr.normal(x + name, (e, rows, cols), 1 / np.sqrt(rows))
    wr.normal(x + "gate_up_proj_bias", (e, 2 * inter), BIAS_STD)
    wr.normal(x + "down_proj_bias", (e, h), BIAS_STD)


def _mla_attention(wr: _Writer, config: dict[str, Any], p: str) -> None:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    a = p + "self_attn."
    if q_lora is None:
        wr.linear(a + "q_proj.weight", heads * (nope + rope), h)
    else:
        wr.linear(a + "q_a_proj.weight", q_lora, h)
        wr.norm(a + "q_a_layernorm.weight", q_lora)
        wr.linear(a + "q_b_proj.weight", heads * (nope + rope), q_lora)
    wr.linear(a + "kv_a_proj_with_mqa.weight", kv_lora + rope, h)
    wr.norm(a + "kv_a_layernorm.weight", kv_lora)
    wr.linear(a + "kv_b_proj.weight", heads * (nope + v), kv_lora)
    wr.linear(a + "o_proj.weight", h, heads * v)


def _swiglu(wr: _Writer, prefix: str, hidden: int, inter: int) -> None:
    wr.linear(prefix + "gate_proj.weight", inter, hidden)
    wr.linear(prefix + "up_proj.weight", inter, hidden)
    wr.linear(prefix + "down_proj.weight", hidden, inter)


def num_mtp_layers(config: dict[str, Any]) -> int:
    """Multi-token-prediction layers the checkpoint holds (DeepSeek-V3 / GLM-4.5 only)."""
    return int(config.get("num_nextn_predict_layers") or 0)


def mtp_layer_ids(config: dict[str, Any]) -> range:
    """Indices of the MTP layers: they follow the decoder layers (L, L + 1, ...)."""
    first = config["num_hidden_layers"]
    return range(first, first + num_mtp_layers(config))


def _qwen3_5_layer(wr: _Writer, config: dict[str, Any], i: int, prefix: str | None = None,
                   ) -> None:
    """Qwen3.5-MoE layer i but its router: (1 + w) norms drawn around 0, Gated DeltaNet or
    gated attention, per-expert experts and the gated shared expert. ``prefix``: the MTP
    layer's (``mtp.layers.0.``, always gated attention) instead of ``model.layers.{i}.``."""
    h, p = config["hidden_size"], prefix or f"model.layers.{i}."
    wr.normal(p + "input_layernorm.weight", (h,), 0.1)
    wr.normal(p + "post_attention_layernorm.weight", (h,), 0.1)
    if prefix is None and config["layer_types"][i] == "linear_attention":
        a = p + "linear_attn."
        hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
        conv, kernel = 2 * hk * dk + hv * dv, config["linear_conv_kernel_dim"]
        wr.linear(a + "in_proj_qkv.weight", conv, h)
        wr.linear(a + "in_proj_z.weight", hv * dv, h)
        wr.linear(a + "in_proj_b.weight", hv, h)
        wr.linear(a + "in_proj_a.weight", hv, h)
        wr.normal(a + "conv1d.weight", (conv, 1, kernel), 1 / np.sqrt(kernel))
        wr.normal(a + "dt_bias", (hv,), 0.5)
        # A = exp(A_log) in [0.05, 2]: decays from slow (memory across chunks) to fast
        g = rng(wr.seed, a + "A_log")
        wr.w[a + "A_log"] = np.log(g.uniform(0.05, 2.0, hv)).astype(np.float32)
        wr.norm(a + "norm.weight", dv)  # the gated output norm multiplies by w itself
        wr.linear(a + "out_proj.weight", h, hv * dv)
    else:
        hd = head_dim(config)
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        a = p + "self_attn."
        wr.linear(a + "q_proj.weight", heads * 2 * hd, h)  # per head: query, then gate
        wr.linear(a + "k_proj.weight", kv_heads * hd, h)
        wr.linear(a + "v_proj.weight", kv_heads * hd, h)
        wr.linear(a + "o_proj.weight", h, heads * hd)
        wr.normal(a + "q_norm.weight", (hd,), 0.1)
        wr.normal(a + "k_norm.weight", (hd,), 0.1)
    for e in range(config["num_experts"]):
        _swiglu(wr, f"{p}mlp.experts.{e}.", h, config["moe_intermediate_size"])
    if config["shared_expert_intermediate_size"] > 0:
        _swiglu(wr, p + "mlp.shared_expert.", h, config["shared_expert_intermediate_size"])
        wr.linear(p + "mlp.shared_expert_gate.weight", 1, h)


def _decoder_layer(wr: _Writer, config: dict[str, Any], i: int, moe: bool) -> None:
    """Layer i's tensors except its router (attention, norms, dense MLP or experts)."""
    fam = family_of(config)
    h = config["hidden_size"]
    p = f"model.layers.{i}."
    if fam.model_type == "qwen3_5_moe_text":
        _qwen3_5_layer(wr, config, i)
        return
    wr.norm(p + "input_layernorm.weight", h)
    wr.norm(p + "post_attention_layernorm.weight", h)
    if fam.model_type == "deepseek_v3":
        _mla_attention(wr, config, p)
    elif fam.model_type == "glm4_moe":
        _gqa_attention(wr, config, p, config["attention_bias"], config["use_qk_norm"])
    elif fam.model_type == "minimax_m2":
        _gqa_attention(wr, config, p, False, False, layer_qk_norm=True)
    elif fam.model_type == "gpt_oss":
        bias = config["attention_bias"]
        _gqa_attention(wr, config, p, bias, False, o_bias=bias, sinks=True)
    else:
        _gqa_attention(wr, config, p, fam.model_type == "qwen2_moe", fam.model_type == "qwen3_moe")
    if not moe:
        _swiglu(wr, p + "mlp.", h, config["intermediate_size"])
        return
    if fam.model_type == "gpt_oss":
        _gpt_oss_experts(wr, config, p)
        return
    if fam.model_type in ("mixtral", "minimax_m2"):
        inter = config["intermediate_size"]
        for e in range(fam.num_experts(config)):
            q = f"{p}block_sparse_moe.experts.{e}."
            wr.linear(q + "w1.weight", inter, h)
            wr.linear(q + "w2.weight", h, inter)
            wr.linear(q + "w3.weight", inter, h)
        return
    for e in range(fam.num_experts(config)):
        _swiglu(wr, f"{p}mlp.experts.{e}.", h, config["moe_intermediate_size"])
    if fam.model_type == "qwen2_moe" and config["shared_expert_intermediate_size"] > 0:
        _swiglu(wr, p + "mlp.shared_expert.", h, config["shared_expert_intermediate_size"])
        # Normed input ~N(0, 1): the gate's logit is ~N(0, 1), sigmoid spread over (0, 1).
        wr.linear(p + "mlp.shared_expert_gate.weight", 1, h)
    if fam.model_type in ("deepseek_v3", "glm4_moe") and config["n_shared_experts"] > 0:
        inter = config["moe_intermediate_size"] * config["n_shared_experts"]
        _swiglu(wr, p + "mlp.shared_experts.", h, inter)


def base_weights(config: dict[str, Any], gen: dict[str, Any], seed: int) -> Tensors:
    """Every tensor except the routers (see router_weights), float32, HF names and orientation.

    Includes the MTP layers (``mtp_weights``) when the config asks for them."""
    fam = family_of(config)
    h, v = config["hidden_size"], config["vocab_size"]
    wr = _Writer(seed)
    tied = bool(config["tie_word_embeddings"])
    # Tied, the embedding doubles as the LM head, so it takes the head's scale; the first
    # input_layernorm makes the embedding scale irrelevant to layer 0.
    wr.normal("model.embed_tokens.weight", (v, h), gen["logit_std"] / np.sqrt(h) if tied else 1.0)
    for i in range(config["num_hidden_layers"]):
        _decoder_layer(wr, config, i, fam.is_moe_layer(config, i))
    if fam.model_type == "qwen3_5_moe_text":  # x * (1 + w)
        wr.normal("model.norm.weight", (h,), 0.1)
    else:
        wr.norm("model.norm.weight", h)
    if not tied:
        # Final-normed hidden entries are ~N(0, 1): logits get std ~logit_std.
        wr.normal("lm_head.weight", (v, h), gen["logit_std"] / np.sqrt(h))
    if fam.model_type == "qwen3_5_moe_text":
        return {**wr.w, **qwen3_5_mtp_weights(config, seed, gen)}
    return {**wr.w, **mtp_weights(config, seed, wr.w)}


def qwen3_5_mtp_weights(config: dict[str, Any], seed: int, gen: dict[str, Any]) -> Tensors:
    """Qwen3.5-MoE's ``mtp_num_hidden_layers`` MTP layers (``mtp.*``, as the release names
    them): ``fc`` [H, 2H] (input: the normed embedding then the normed hidden state),
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``norm`` ((1 + w) norms, drawn around
    0), and per layer j a gated-attention MoE layer ``mtp.layers.{j}.*`` with its router
    (not searched: a draft's routing is never returned). No copy of the embedding or head:
    the MTP layer uses the main model's."""
    n = int(config.get("mtp_num_hidden_layers") or 0)
    if not n:
        return {}
    h, wr = config["hidden_size"], _Writer(seed)
    wr.linear("mtp.fc.weight", h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        wr.normal(f"mtp.{norm}.weight", (h,), 0.1)
    for j in range(n):
        p = f"mtp.layers.{j}."
        _qwen3_5_layer(wr, config, j, prefix=p)
        w = rng(seed, p + "mlp.gate.weight").standard_normal((config["num_experts"], h))
        wr.w[p + "mlp.gate.weight"] = (w * gen["router_std"] / np.sqrt(h)).astype(np.float32)
    return wr.w


def mtp_weights(config: dict[str, Any], seed: int, main: Tensors) -> Tensors:
    """The MTP layers' tensors but their routers, in DeepSeek-V3's / GLM-4.5's HF layout.

    MTP layer j sits at index L + j (L = num_hidden_layers) and holds ``enorm``, ``hnorm``
    (norm weights [H]), ``eh_proj`` [H, 2H] (input: the enorm'd embedding then the hnorm'd
    feature, both ~N(0, 1), so std 1/sqrt(2H)), ``shared_head.norm`` [H], exact copies of the
    main model's embedding (``embed_tokens``) and LM head (``shared_head.head``), and a full
    decoder layer named as a main layer would be, always a MoE layer (routers: router_weights).
    ``main``: the main model's tensors (the copies' sources)."""
    if not num_mtp_layers(config):
        return {}
    fam = family_of(config)
    if fam.model_type not in ("deepseek_v3", "glm4_moe"):
        raise ValueError(f"{fam.model_type} checkpoints hold no MTP layers")
    h = config["hidden_size"]
    head = main["model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"]
    wr = _Writer(seed)
    for i in mtp_layer_ids(config):
        p = f"model.layers.{i}."
        wr.norm(p + "enorm.weight", h)
        wr.norm(p + "hnorm.weight", h)
        wr.linear(p + "eh_proj.weight", h, 2 * h)
        wr.norm(p + "shared_head.norm.weight", h)
        wr.w[p + "shared_head.head.weight"] = head.copy()
        wr.w[p + "embed_tokens.weight"] = main["model.embed_tokens.weight"].copy()
        _decoder_layer(wr, config, i, moe=True)
    return wr.w


def router_weights(
    config: dict[str, Any], gen: dict[str, Any], seed: int, attempts: dict[int, int]
) -> Tensors:
    """Router tensors of every MoE layer; layer i uses router sub-seed attempts.get(i, 0).

    The router's input is RMS-normalised (entries ~N(0, 1)), so a weight std of
    router_std/sqrt(H) gives router logits of std ~router_std. Sigmoid routers also get their
    ``e_score_correction_bias`` [E], N(0, score_bias_std^2), redrawn with the weight. The MTP
    layers' routers (always MoE) come last; the router search never redraws them.
    """
    fam = family_of(config)
    hidden, experts = config["hidden_size"], fam.num_experts(config)
    out: Tensors = {}
    mtp = set(mtp_layer_ids(config))
    for i in range(config["num_hidden_layers"] + len(mtp)):
        if i not in mtp and not fam.is_moe_layer(config, i):
            continue
        name = fam.router_name(i)
        attempt = attempts.get(i, 0)
        w = rng(seed, name, attempt).standard_normal((experts, hidden))
        out[name] = (w * gen["router_std"] / np.sqrt(hidden)).astype(np.float32)
        if fam.router_rule == "sigmoid_grouped":
            bias_name = f"model.layers.{i}.{fam.mlp_prefix}.{fam.score_bias}"
            b = rng(seed, bias_name, attempt).standard_normal(experts)
            out[bias_name] = (b * gen["score_bias_std"]).astype(np.float32)
        if fam.model_type == "gpt_oss":  # the router's own bias, of the logits' scale
            bias_name = f"model.layers.{i}.mlp.router.bias"
            b = rng(seed, bias_name, attempt).standard_normal(experts)
            out[bias_name] = (b * gen["router_std"] * 0.3).astype(np.float32)
    return out
