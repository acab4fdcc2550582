"""The model's configuration, normalised once from a Hugging Face checkpoint.

Model code never reads the raw HF ``config.json``: everything it needs is a field of the
frozen :class:`ModelConfig`, so a checkpoint that lacks a field or sets it to an unsupported
value fails here, at load time, with a message that names the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_jax.srt.bounded_text import bound_message, short_repr
from sgl_jax.srt.configs.config_reader import (  # noqa: F401 - re-exported
    INT_MAX,
    MAX_CONFIG_BYTES,
    ConfigReader,
    json_kind,
    read_config_json,
)
from sgl_jax.srt.configs.families import (  # noqa: F401 - is_moe_layer re-exported
    DEQUANTISED_AT_LOAD,
    FAMILY_READERS,
    check_groups,
    is_moe_layer,
    text_fields,
)
from sgl_jax.srt.configs.rope_scaling import RopeScaling

BUNDLED_MODEL_PATH = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-moe")
# Its EAGLE draft head (speculative/eagle.py; trained by tools/train_eagle.py).
BUNDLED_EAGLE_DRAFT_PATH = BUNDLED_MODEL_PATH + "-eagle"

MAX_LAYERS = 1024  # num_hidden_layers: released MoE models have < 100

# HF architecture name -> our model family (families.py says how each one's config.json reads).
SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "GptOssForCausalLM",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
)
# Read by ModelConfig but not served by the engine (none at the moment; Qwen3.5-MoE was until
# its Gated DeltaNet states were wired into the step).
CONFIG_ONLY_ARCHITECTURES: tuple[str, ...] = ()


def resolve_model_path(model_path: str | None) -> str:
    """``None`` means the bundled tiny checkpoint; anything else must be a local directory."""
    if model_path is None:
        return BUNDLED_MODEL_PATH
    path = os.path.expanduser(model_path)
    if not os.path.isdir(path):
        raise ValueError(
            f"model_path {model_path!r} is not a directory. Pass a local Hugging Face "
            "checkpoint directory (config.json, *.safetensors, tokenizer.json); models cannot "
            "be downloaded here. Omit model_path to use the bundled tiny Qwen3-MoE model, or "
            "write one with `python -m sgl_jax.tools.make_random_model OUT`."
        )
    return path


ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")  # layers/moe/router.py


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # each routed expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # of q and k (MLA: qk_nope_head_dim + qk_rope_head_dim)
    num_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per layer: has a router
    rms_norm_eps: float
    rope_theta: float
    context_len: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    # -- what differs between families (defaults: Qwen3-MoE) --------------------------------
    family: str = "qwen3_moe"
    router: str = "softmax_topk"  # one of ROUTERS
    n_group: int = 1  # sigmoid_grouped: expert groups, of which topk_group are kept
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    num_shared_experts: int = 0  # experts every token uses besides its top-k (never returned)
    shared_expert_intermediate_size: int = 0  # their total width
    shared_expert_gated: bool = False  # Qwen2-MoE: scaled by sigmoid(x @ shared_expert_gate)
    attention: str = "gqa"  # "gqa" or "mla" (multi-head latent attention)
    qk_norm: bool = True  # RMSNorm of each q and k head before RoPE
    qk_norm_per_layer: bool = False  # MiniMax-M2: one RMSNorm over all heads' q (k) instead
    qkv_bias: bool = False  # biases on the q, k and v projections
    o_proj_bias: bool = False  # and on o_proj (gpt-oss)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    sliding_window: int = 0  # a sliding layer's query sees its last sliding_window keys
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends over the window only
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (partial rotary); 0: head_dim
    rope_interleaved: bool = False  # rotation pairs are (even, odd) dims, not the two halves
    rope_scaling: RopeScaling | None = None
    # Router extras: gpt-oss's router has a bias added to its logits; MiniMax-M2 keeps its
    # e_score_correction_bias on the MoE block, not on the gate.
    router_bias: bool = False
    score_bias_on_block: bool = False
    # Experts: "silu" (silu(gate) * up) or "clamped_swiglu" (gpt-oss: gate clamped above and
    # up on both sides at swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)), and
    # biases on the gate/up and down projections (gpt-oss).
    expert_activation: str = "silu"
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    expert_bias: bool = False
    # Qwen3.5-MoE: decoder and q/k RMSNorms compute x * (1 + w); q_proj gives [query | gate]
    # per head and the attention output is multiplied by sigmoid(gate); per layer, Gated
    # DeltaNet (linear attention) instead of full attention, with its head counts and widths.
    norm_plus_one: bool = False
    attn_output_gate: bool = False
    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    mtp_num_hidden_layers: int = 0  # MTP layers the checkpoint holds (mtp.*), not served yet
    # MLA (attention == "mla")
    q_lora_rank: int | None = None  # None: q_proj directly from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # EPLB (set by the server, not by a checkpoint: layers/moe/placement.py): the MoE blocks hold
    # num_experts + num_redundant_experts physical expert rows and a placement as data.
    eplb: bool = False
    num_redundant_experts: int = 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @property
    def num_physical_experts(self) -> int:
        return self.num_experts + self.num_redundant_experts

    def layer_window(self, layer_id: int) -> int:
        """Keys a query of the layer sees, itself included (0: all before it)."""
        slides = bool(self.sliding_layers) and self.sliding_layers[layer_id]
        return self.sliding_window if slides else 0

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's causal conv: q, k and v concatenated."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    # -- the KV cache: per layer [pages, page_size, kv_cache_heads, kv_cache_head_dim] ---------
    @property
    def kv_cache_heads(self) -> int:
        """GQA: K and V of each KV head, interleaved (attention/base.py). MLA: one latent row
        (the compressed KV and the shared RoPE key) that every head reads."""
        return 1 if self.attention == "mla" else 2 * self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def kv_cache_sharded(self) -> bool:
        """Split over the "tensor" axis by head (GQA); MLA's latent row is replicated."""
        return self.attention != "mla"

    def routing_info(self) -> dict[str, Any]:
        """What a client needs to reshape and interpret routed-experts rows (/get_model_info)."""
        return {
            "family": self.family,
            "num_hidden_layers": self.num_hidden_layers,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_layers": list(self.moe_layer_ids),
            "router": self.router,
            "norm_topk_prob": self.norm_topk_prob,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_shared_experts": self.num_shared_experts,
            "router_bias": self.router_bias,
        }

    @staticmethod
    def from_hf(model_path: str | None = None, context_length: int | None = None) -> ModelConfig:
        """The config of a checkpoint directory. Raises ValueError naming the path and what is
        wrong for anything that is not a readable, well-formed and supported config.json."""
        path = resolve_model_path(model_path)
        return ModelConfig.from_dict(read_config_json(path), path, context_length)

    @staticmethod
    def from_dict(
        hf: Any, model_path: str, context_length: int | None = None
    ) -> ModelConfig:
        """Raises ValueError for every malformed or unsupported config: the typed reads below
        name the field; anything they miss (a bug here, not the operator's) still becomes a
        ValueError naming the file, so a caller that handles ValueError handles every config."""
        if not isinstance(hf, dict):
            raise ValueError(
                f"{model_path}/config.json holds a JSON {json_kind(hf)}; a Hugging Face "
                "config.json is a JSON object")
        try:
            return ModelConfig._from_dict(hf, model_path, context_length)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - see the docstring
            raise ValueError(
                f"{model_path}/config.json is malformed ({type(e).__name__}: "
                f"{bound_message(str(e), 200)})") from e

    @staticmethod
    def _from_dict(
        hf: dict[str, Any], model_path: str, context_length: int | None
    ) -> ModelConfig:
        read = ConfigReader(hf, model_path)
        architectures = read.get("architectures", [])
        if not isinstance(architectures, list):
            raise ValueError(f"{read.where('architectures')} must be a list of names, "
                             f"not {short_repr(architectures)}")
        known = SUPPORTED_ARCHITECTURES + CONFIG_ONLY_ARCHITECTURES
        arch = next((a for a in architectures if a in known), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {short_repr(architectures)} in "
                f"{model_path}/config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quant = hf.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if quant and method in DEQUANTISED_AT_LOAD.get(arch, ()):
            quant = None  # the loader dequantises it (model_loader/mxfp4.py)
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(
                f"{model_path}/config.json describes a quantised checkpoint (quantization_config "
                f"{short_repr(method)}), which is not supported: serve unquantised float32, "
                f"bfloat16 or float16 weights of {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(dequantise first; gpt-oss's MXFP4 release is the exception, dequantised at "
                "load)"
            )
        text, prefix = text_fields(hf, arch, model_path)  # (Qwen3.5: under text_config)
        read = ConfigReader(text, model_path, prefix)
        fields = FAMILY_READERS[arch](read)
        num_layers = read.int("num_hidden_layers", hi=MAX_LAYERS)
        num_heads = read.int("num_attention_heads")
        num_kv_heads = read.int("num_key_value_heads", num_heads)
        hidden = read.int("hidden_size")
        if "head_dim" not in fields:
            fields["head_dim"] = read.int("head_dim", hidden // num_heads)
        num_experts, top_k = fields["num_experts"], fields["num_experts_per_tok"]
        if fields.get("attention", "gqa") == "gqa" and num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        moe_rule = fields.pop("moe_rule")
        rope_theta = fields.pop("rope_theta", None) or read.rope_theta(10000.0)
        moe_layers = tuple(bool(moe_rule(i)) for i in range(num_layers))
        check_groups(fields)

        eos = read.get("eos_token_id")
        eos_ids = tuple(read.int_list("eos_token_id", lo=0)) if isinstance(eos, list) else (
            () if eos is None else (read.int("eos_token_id", lo=0),))
        bos = read.get("bos_token_id")
        max_pos = read.int("max_position_embeddings", 2048)
        torch_dtype = read.get("torch_dtype", read.get("dtype", "float32"))  # (5: "dtype")
        if not isinstance(torch_dtype, str):
            raise ValueError(f"{read.where('torch_dtype')} must be a dtype name such as "
                             f"'bfloat16', not {short_repr(torch_dtype)}")
        return ModelConfig(
            model_path=model_path,
            architecture=arch,
            vocab_size=read.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=read.int("intermediate_size", 0, lo=0),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            moe_layers=moe_layers,
            rms_norm_eps=read.float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            context_len=int(context_length or max_pos),
            tie_word_embeddings=read.bool("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else read.int("bos_token_id", lo=0),
            torch_dtype=torch_dtype,
            **fields,
        )


