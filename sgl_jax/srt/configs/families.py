"""How each supported architecture's ``config.json`` reads: one reader per family.

A reader takes the config (through :class:`ConfigReader`, whose errors name the field) and
returns the ``ModelConfig`` fields that differ between families, plus ``moe_rule`` (layer ->
has a router). What every family shares (sizes, norms' epsilon, vocabulary, ids) is read by
``ModelConfig.from_dict`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sgl_jax.srt.bounded_text import short_repr
from sgl_jax.srt.configs.config_reader import ConfigReader
from sgl_jax.srt.configs.rope_scaling import RopeScaling


def is_moe_layer(
    layer_id: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...]
) -> bool:
    """Qwen-MoE's rule for which decoder layers have a router (the others are dense MLPs)."""
    return (
        layer_id not in mlp_only_layers
        and num_experts > 0
        and (layer_id + 1) % decoder_sparse_step == 0
    )


def _qwen_moe(read: ConfigReader, qwen2: bool) -> dict[str, Any]:
    read.default_rope_only()
    if read.bool("use_sliding_window", False):
        raise ValueError("use_sliding_window=true is not supported (sliding-window attention)")
    num_experts = read.int("num_experts")
    sparse_step = read.int("decoder_sparse_step", 1)
    if sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={sparse_step} must be >= 1")
    mlp_only = tuple(read.int_list("mlp_only_layers"))
    fields: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": read.int("moe_intermediate_size"),
        "norm_topk_prob": read.bool("norm_topk_prob", False),
        "moe_rule": lambda i: is_moe_layer(i, num_experts, sparse_step, mlp_only),
    }
    if qwen2:
        shared = read.int("shared_expert_intermediate_size", 0, lo=0)
        fields.update(
            family="qwen2_moe", qk_norm=False, qkv_bias=read.bool("qkv_bias", True),
            num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared,
            shared_expert_gated=True,
        )
    return fields


def _mixtral(read: ConfigReader) -> dict[str, Any]:
    read.default_rope_only()
    if read.get("sliding_window") is not None:
        raise ValueError("sliding_window is not supported (sliding-window attention): set it null")
    return {
        "family": "mixtral", "router": "topk_softmax", "qk_norm": False,
        "num_experts": read.int("num_local_experts"),
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": read.int("intermediate_size"),
        "norm_topk_prob": True,  # the k weights are a softmax over the selected logits
        "moe_rule": lambda i: True,
    }


def _grouped_sigmoid(read: ConfigReader) -> dict[str, Any]:
    """The router and shared experts DeepSeek-V3 and GLM-4.5 have in common."""
    num_shared = read.int("n_shared_experts", 0, lo=0)
    moe_width = read.int("moe_intermediate_size")
    return {
        "router": "sigmoid_grouped",
        "num_experts": read.int("n_routed_experts"),
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": moe_width,
        "norm_topk_prob": read.bool("norm_topk_prob", True),
        "n_group": read.int("n_group", 1),
        "topk_group": read.int("topk_group", 1),
        "routed_scaling_factor": read.float("routed_scaling_factor", 1.0),
        "num_shared_experts": num_shared,
        "shared_expert_intermediate_size": num_shared * moe_width,
    }


def _deepseek_v3(read: ConfigReader) -> dict[str, Any]:
    method = read.str("topk_method", "noaux_tc")
    scoring = read.str("scoring_func", "sigmoid")
    if (method, scoring) != ("noaux_tc", "sigmoid"):
        raise ValueError(
            f"topk_method={short_repr(method)} with scoring_func={short_repr(scoring)} is not "
            "supported; "
            "DeepseekV3ForCausalLM supports topk_method='noaux_tc' with scoring_func='sigmoid'"
        )
    first_dense = read.int("first_k_dense_replace", 0, lo=0)
    freq = read.int("moe_layer_freq", 1)
    nope, rope = read.int("qk_nope_head_dim", lo=0), read.int("qk_rope_head_dim")
    q_lora = read.get("q_lora_rank")
    fields = _grouped_sigmoid(read)
    fields.update(
        family="deepseek_v3", attention="mla", qk_norm=False,
        q_lora_rank=None if q_lora is None else read.int("q_lora_rank"),
        kv_lora_rank=read.int("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=read.int("v_head_dim"), head_dim=nope + rope, rotary_dim=rope,
        rope_interleaved=read.bool("rope_interleave", True),
        rope_scaling=_yarn(read),
        moe_rule=lambda i: i >= first_dense and i % freq == 0,
    )
    return fields


def _yarn(read: ConfigReader) -> RopeScaling | None:
    kind = read.rope_type()
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {short_repr(kind)} is not supported; supported: "
                         "yarn, default")
    scaling = read.rope()
    assert scaling is not None  # rope_type() found one
    factor = scaling.get("attention_factor")
    return RopeScaling(
        factor=scaling.float("factor"),
        original_max_position_embeddings=scaling.int("original_max_position_embeddings"),
        beta_fast=scaling.float("beta_fast", 32.0),
        beta_slow=scaling.float("beta_slow", 1.0),
        mscale=scaling.float("mscale", 1.0, positive=False),
        mscale_all_dim=scaling.float("mscale_all_dim", 0.0, positive=False),
        truncate=scaling.bool("truncate", True),
        explicit_attention_factor=None if factor is None else scaling.float("attention_factor"),
    )


def _glm4_moe(read: ConfigReader) -> dict[str, Any]:
    read.default_rope_only()
    first_dense = read.int("first_k_dense_replace", 0, lo=0)
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim = read.int("head_dim", hidden // heads)
    rotary_fraction = read.float("partial_rotary_factor", 0.5)
    if rotary_fraction > 1:
        raise ValueError(f"{read.where('partial_rotary_factor')} is {rotary_fraction}; it must "
                         "be in (0, 1]")
    fields = _grouped_sigmoid(read)
    fields.update(
        family="glm4_moe", head_dim=head_dim,
        qk_norm=read.bool("use_qk_norm", False),
        qkv_bias=read.bool("attention_bias", False),
        rotary_dim=int(head_dim * rotary_fraction),
        moe_rule=lambda i: i >= first_dense,
    )
    return fields


def check_groups(fields: dict[str, Any]) -> None:
    experts, groups, keep = fields["num_experts"], fields.get("n_group", 1), fields.get("topk_group", 1)
    if groups < 1 or experts % groups:
        raise ValueError(f"n_group={groups} must divide the {experts} routed experts")
    if not 1 <= keep <= groups:
        raise ValueError(f"topk_group={keep} must be in [1, n_group={groups}]")
    if fields["num_experts_per_tok"] > keep * (experts // groups):
        raise ValueError(
            f"num_experts_per_tok={fields['num_experts_per_tok']} exceeds the experts of the "
            f"topk_group={keep} kept groups ({keep * (experts // groups)})"
        )


def _minimax_m2(read: ConfigReader) -> dict[str, Any]:
    """MiniMax-M2: every layer MoE; sigmoid routing whose selection adds
    ``e_score_correction_bias`` (held by the MoE block, ``block_sparse_moe``, not its gate),
    weights the chosen unbiased scores renormalised; one RMSNorm over all heads' q (and k)
    before they are split (``qk_norm_type`` per_layer); rotary on the first ``rotary_dim``
    dims of a head."""
    read.default_rope_only()
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim = read.int("head_dim", hidden // heads)
    if read.get("rotary_dim") is not None:
        rotary = read.int("rotary_dim", hi=head_dim)
    else:  # transformers 5 writes it as rope_parameters.partial_rotary_factor too
        rope = read.rope()
        fraction = 1.0 if rope is None else rope.float("partial_rotary_factor", 1.0)
        rotary = int(head_dim * fraction)
    if rotary % 2 or not 2 <= rotary <= head_dim:
        raise ValueError(f"{read.where('rotary_dim')}: {rotary} rotary dims; RoPE rotates "
                         f"pairs, so it must be even and in [2, head_dim={head_dim}]")
    scoring = read.str("scoring_func", "sigmoid")
    if scoring != "sigmoid" or not read.bool("use_routing_bias", True):
        raise ValueError(f"{read.where('scoring_func')}: MiniMaxM2ForCausalLM is supported with "
                         "scoring_func='sigmoid' and use_routing_bias=true (its release)")
    if read.int("shared_intermediate_size", 0, lo=0):
        raise ValueError(f"{read.where('shared_intermediate_size')}: MiniMax-M2 has no shared "
                         "experts; a non-zero width is not supported")
    attn_types = read.int_list("attn_type_list")
    if any(t != 1 for t in attn_types):
        raise ValueError(f"{read.where('attn_type_list')}: only full attention layers (1) are "
                         "supported (MiniMax-M2); lightning-attention layers (0) are not")
    norm_type = read.str("qk_norm_type", "per_layer")
    if norm_type not in ("per_layer", "per_head"):
        raise ValueError(f"{read.where('qk_norm_type')} is {short_repr(norm_type)}; supported: "
                         "'per_layer', 'per_head'")
    return {
        "family": "minimax_m2", "router": "sigmoid_grouped", "head_dim": head_dim,
        "num_experts": read.int("num_local_experts"),
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": read.int("intermediate_size"),
        "norm_topk_prob": True,  # the chosen scores always sum to 1, no scaling factor
        "score_bias_on_block": True,
        "qk_norm": read.bool("use_qk_norm", True),
        "qk_norm_per_layer": norm_type == "per_layer",
        "rotary_dim": rotary,
        "rope_theta": read.rope_theta(5_000_000.0),
        "moe_rule": lambda i: True,
    }


SLIDING, FULL = "sliding_attention", "full_attention"


def _gpt_oss(read: ConfigReader) -> dict[str, Any]:
    """gpt-oss: every layer MoE; a router with a bias (top-k of the logits, softmax over the
    k chosen); experts with biases and a clamped SwiGLU; attention sinks; sliding-window
    attention on the layers ``layer_types`` names; YaRN."""
    num_layers = read.int("num_hidden_layers")
    types = read.get("layer_types")
    if types is None:  # transformers' default: even layers slide, odd ones attend fully
        types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (SLIDING, FULL) for t in types)):
        raise ValueError(f"{read.where('layer_types')} must list {num_layers} entries, each "
                         f"'{SLIDING}' or '{FULL}'; got {short_repr(types)}")
    sliding = tuple(t == SLIDING for t in types)
    window = read.int("sliding_window") if any(sliding) else 0
    bias = read.bool("attention_bias", True)
    return {
        "family": "gpt_oss", "router": "topk_softmax", "router_bias": True, "qk_norm": False,
        "num_experts": read.int("num_local_experts"),
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": read.int("intermediate_size"),
        "norm_topk_prob": True,  # a softmax over the k selected logits
        "qkv_bias": bias, "o_proj_bias": bias, "attention_sinks": True,
        "sliding_window": window, "sliding_layers": sliding,
        "rope_scaling": _yarn(read), "rope_theta": read.rope_theta(150_000.0),
        "expert_activation": "clamped_swiglu", "expert_bias": True,
        "swiglu_limit": read.float("swiglu_limit", 7.0),
        "swiglu_alpha": read.float("swiglu_alpha", 1.702),
        "moe_rule": lambda i: True,
    }


LINEAR, FULL_ATTN = "linear_attention", "full_attention"


def _qwen3_5_moe(read: ConfigReader) -> dict[str, Any]:
    """Qwen3.5-MoE (text fields; the released form nests them under ``text_config``, see
    ``text_fields``): every layer MoE, softmax top-k always renormalised plus one shared expert
    scaled by sigmoid(``shared_expert_gate``(x)); ``layer_types`` names each layer Gated
    DeltaNet (``linear_attention``) or gated full attention (q_proj gives [query | gate] per
    head); RMSNorms compute x * (1 + w); partial rotary (rotate-half) on
    ``partial_rotary_factor`` of a head (0.25 by default)."""
    num_layers = read.int("num_hidden_layers", hi=1024)
    types = read.get("layer_types")
    if types is None:  # transformers' rule: layer i attends fully iff (i + 1) % interval == 0
        interval = read.int("full_attention_interval", 4)
        types = [FULL_ATTN if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (LINEAR, FULL_ATTN) for t in types)):
        raise ValueError(f"{read.where('layer_types')} must list {num_layers} entries, each "
                         f"'{LINEAR}' or '{FULL_ATTN}'; got {short_repr(types)}")
    hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
    head_dim = read.int("head_dim", hidden // heads)
    rope = read.rope()
    kind = None if rope is None else rope.str("rope_type", rope.str("type", "default"))
    if kind not in (None, "default"):
        raise ValueError(f"{read.where('rope_parameters')}: rope_type {short_repr(kind)} is not "
                         "supported; supported: default (mrope sections do not matter for text)")
    if read.get("partial_rotary_factor") is not None:
        fraction = read.float("partial_rotary_factor")
    elif rope is not None and rope.get("partial_rotary_factor") is not None:
        fraction = rope.float("partial_rotary_factor")  # (where transformers 5 writes it)
    else:
        fraction = 0.25  # transformers' default for this family
    rotary = int(head_dim * fraction)
    if rotary % 2 or not 2 <= rotary <= head_dim:
        raise ValueError(f"{read.where('partial_rotary_factor')}: {rotary} rotary dims of "
                         f"head_dim={head_dim}; it must be even and in [2, head_dim]")
    key_heads = read.int("linear_num_key_heads")
    value_heads = read.int("linear_num_value_heads")
    if value_heads % key_heads:
        raise ValueError(f"{read.where('linear_num_value_heads')}={value_heads} is not a "
                         f"multiple of linear_num_key_heads={key_heads}")
    if read.str("hidden_act", "silu") != "silu":
        raise ValueError(f"{read.where('hidden_act')}: only silu is supported (Qwen3.5-MoE)")
    shared = read.int("shared_expert_intermediate_size", 0, lo=0)
    return {
        "family": "qwen3_5_moe", "router": "softmax_topk", "head_dim": head_dim,
        "num_experts": read.int("num_experts"),
        "num_experts_per_tok": read.int("num_experts_per_tok"),
        "moe_intermediate_size": read.int("moe_intermediate_size"),
        "norm_topk_prob": True,  # the router always renormalises its top-k
        "num_shared_experts": 1 if shared else 0, "shared_expert_intermediate_size": shared,
        "shared_expert_gated": True,
        "qk_norm": True, "qkv_bias": read.bool("attention_bias", False),
        "o_proj_bias": read.bool("attention_bias", False),
        "norm_plus_one": True, "attn_output_gate": True, "rotary_dim": rotary,
        "rope_theta": read.rope_theta(10_000_000.0),
        "linear_layers": tuple(t == LINEAR for t in types),
        "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
        "linear_key_head_dim": read.int("linear_key_head_dim"),
        "linear_value_head_dim": read.int("linear_value_head_dim"),
        "linear_conv_kernel_dim": read.int("linear_conv_kernel_dim", 4, lo=2),
        "mtp_num_hidden_layers": read.int("mtp_num_hidden_layers", 0, lo=0),
        "moe_rule": lambda i: True,
    }


# Architectures whose language-model fields sit under ``text_config`` (vision-language
# releases); tensors of the language model are under ``model.language_model.``.
NESTED_TEXT_CONFIG = ("Qwen3_5MoeForConditionalGeneration",)


def text_fields(hf: dict[str, Any], arch: str, model_path: str) -> tuple[dict[str, Any], str]:
    """The config dict the readers see, and the prefix their error messages give a field: for
    a nested architecture ``text_config`` over the top level (ids and ``tie_word_embeddings``
    may be written at either), else ``hf`` itself."""
    if arch not in NESTED_TEXT_CONFIG:
        return hf, ""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{model_path}/config.json: {arch} needs a text_config object (the "
                         f"language model's fields), got {short_repr(text)}")
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    return {**top, **{k: v for k, v in text.items() if v is not None}}, "text_config."


# Quantised checkpoints a family's loader dequantises (quant_method per architecture).
DEQUANTISED_AT_LOAD: dict[str, tuple[str, ...]] = {"GptOssForCausalLM": ("mxfp4",)}

FAMILY_READERS: dict[str, Callable[[ConfigReader], dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": lambda read: _qwen_moe(read, qwen2=False),
    "Qwen2MoeForCausalLM": lambda read: _qwen_moe(read, qwen2=True),
    "MixtralForCausalLM": _mixtral,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "Glm4MoeForCausalLM": _glm4_moe,
    "MiniMaxM2ForCausalLM": _minimax_m2,
    "GptOssForCausalLM": _gpt_oss,
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe,
}
