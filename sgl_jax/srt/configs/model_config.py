"""The model's configuration, normalised once from a Hugging Face checkpoint.

Model code never reads the raw HF ``config.json``: everything it needs is a field of the
frozen :class:`ModelConfig`, so a checkpoint that lacks a field or sets it to an unsupported
value fails here, at load time, with a message that names the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_jax.srt.bounded_text import bound_message, short_repr

BUNDLED_MODEL_PATH = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-moe")
# Its EAGLE draft head (speculative/eagle.py; trained by tools/train_eagle.py).
BUNDLED_EAGLE_DRAFT_PATH = BUNDLED_MODEL_PATH + "-eagle"

INT_MAX = 2**31 - 1  # integer fields: sizes and counts index int32 arrays
MAX_LAYERS = 1024  # num_hidden_layers: released MoE models have < 100
MAX_CONFIG_BYTES = 16 * 2**20  # config.json files are a few KB

# HF architecture name -> our model family (families.py says how each one's config.json reads).
SUPPORTED_ARCHITECTURES = (
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
)


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


def is_moe_layer(
    layer_id: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...]
) -> bool:
    """Qwen-MoE's rule for which decoder layers have a router (the others are dense MLPs)."""
    return (
        layer_id not in mlp_only_layers
        and num_experts > 0
        and (layer_id + 1) % decoder_sparse_step == 0
    )


ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")  # layers/moe/router.py


@dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension (DeepSeek-V3's ``rope_scaling``), as transformers defines it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @staticmethod
    def yarn_mscale(factor: float, mscale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """Multiplies cos and sin (transformers' YaRN ``attention_factor``)."""
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(
                self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor, 1.0)

    @property
    def softmax_mscale(self) -> float:
        """MLA multiplies its softmax scale by the square of this (DeepSeek-V3)."""
        return self.yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


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
    qkv_bias: bool = False  # biases on the q, k and v projections
    rotary_dim: int = 0  # leading dims of a head that RoPE rotates (partial rotary); 0: head_dim
    rope_interleaved: bool = False  # rotation pairs are (even, odd) dims, not the two halves
    rope_scaling: RopeScaling | None = None
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
                f"{model_path}/config.json holds a JSON {_json_kind(hf)}; a Hugging Face "
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
        read = _ConfigReader(hf, model_path)
        architectures = read.get("architectures", [])
        if not isinstance(architectures, list):
            raise ValueError(f"{read.where('architectures')} must be a list of names, "
                             f"not {short_repr(architectures)}")
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {short_repr(architectures)} in "
                f"{model_path}/config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        quant = hf.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(
                f"{model_path}/config.json describes a quantised checkpoint (quantization_config "
                f"{short_repr(method)}), which is not supported: serve unquantised float32, "
                f"bfloat16 or float16 weights of {', '.join(SUPPORTED_ARCHITECTURES)} "
                "(dequantise first)"
            )
        fields = _FAMILY_READERS[arch](read)
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
        moe_layers = tuple(bool(moe_rule(i)) for i in range(num_layers))
        _check_groups(fields)

        eos = read.get("eos_token_id")
        eos_ids = tuple(read.int_list("eos_token_id", lo=0)) if isinstance(eos, list) else (
            () if eos is None else (read.int("eos_token_id", lo=0),))
        bos = read.get("bos_token_id")
        max_pos = read.int("max_position_embeddings", 2048)
        torch_dtype = read.get("torch_dtype", "float32")
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
            rope_theta=read.float("rope_theta", 10000.0),
            context_len=int(context_length or max_pos),
            tie_word_embeddings=read.bool("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else read.int("bos_token_id", lo=0),
            torch_dtype=torch_dtype,
            **fields,
        )


def read_config_json(path: str) -> Any:
    """The parsed ``config.json`` of a checkpoint directory (any JSON value: ``from_dict``
    checks it is an object). Errors name the file and never quote its contents."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path} has no config.json; it is not a Hugging Face checkpoint")
    try:
        size = os.path.getsize(config_file)
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{config_file} is {size} bytes; a config.json of more than "
                             f"{MAX_CONFIG_BYTES} bytes is not a model config")
        with open(config_file, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read {config_file}: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{config_file} is not UTF-8 text (byte {e.start}); "
                         "a config.json is UTF-8 JSON") from e
    try:
        return json.loads(text)
    except ValueError as e:  # json.JSONDecodeError, or an integer of too many digits
        where = (f" at line {e.lineno} column {e.colno}"
                 if isinstance(e, json.JSONDecodeError) else "")
        reason = e.msg if isinstance(e, json.JSONDecodeError) else bound_message(str(e), 120)
        raise ValueError(f"{config_file} is not valid JSON{where}: {reason}") from e


def _json_kind(value: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


class _ConfigReader:
    """Typed reads of config.json fields, with errors that name the file and the field.

    Values are taken as JSON gives them: an integer field must be a JSON integer (not a
    string, a boolean or a float) within its bounds, a float field a finite number, a boolean
    field true or false. A field set to null counts as absent (its default, or an error if it
    has none)."""

    def __init__(self, hf: dict[str, Any], model_path: str, prefix: str = "") -> None:
        self.hf, self.model_path, self.prefix = hf, model_path, prefix  # prefix: "parent."

    def where(self, key: str) -> str:
        return f"{self.model_path}/config.json: {self.prefix}{key}"

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise ValueError(f"{self.model_path}/config.json lacks the field "
                             f"{self.prefix + key!r}")
        return self.hf[key]

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = INT_MAX) -> int:
        value = self.need(key) if default is None else self.get(key, default)
        return self.check_int(key, value, lo, hi)

    def check_int(self, key: str, value: Any, lo: int = 1, hi: int = INT_MAX) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be an integer")
        if not lo <= value <= hi:
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be in "
                             f"[{lo}, {hi}]")
        return value

    def int_list(self, key: str, lo: int = 0, hi: int = INT_MAX) -> list[int]:
        value = self.get(key, [])
        if not isinstance(value, list):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be a list of "
                             "integers")
        return [self.check_int(key, v, lo, hi) for v in value]

    def float(self, key: str, default: float | None = None, positive: bool = True) -> float:
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value) or (positive and value <= 0):
            kind = "a positive number" if positive else "a finite number"
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be {kind}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be true or "
                             "false")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be a string")
        return value

    def sub(self, key: str) -> _ConfigReader | None:
        """A nested object (``rope_scaling``), read with the same checks; None if absent."""
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"{self.where(key)} is {short_repr(value)}; it must be an object")
        return _ConfigReader(value, self.model_path, f"{self.prefix}{key}.")

    def rope_type(self) -> str | None:
        """``rope_scaling``'s type: None without one, "" if it names none."""
        scaling = self.sub("rope_scaling")
        if scaling is None or not scaling.hf:
            return None
        return scaling.str("rope_type", scaling.str("type", ""))

    def default_rope_only(self) -> None:
        kind = self.rope_type()
        if kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {short_repr(kind)} is not supported for this "
                             "architecture")


def _qwen_moe(read: _ConfigReader, qwen2: bool) -> dict[str, Any]:
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


def _mixtral(read: _ConfigReader) -> dict[str, Any]:
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


def _grouped_sigmoid(read: _ConfigReader) -> dict[str, Any]:
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


def _deepseek_v3(read: _ConfigReader) -> dict[str, Any]:
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


def _yarn(read: _ConfigReader) -> RopeScaling | None:
    kind = read.rope_type()
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {short_repr(kind)} is not supported; supported: "
                         "yarn, default")
    scaling = read.sub("rope_scaling")
    assert scaling is not None  # rope_type() found one
    return RopeScaling(
        factor=scaling.float("factor"),
        original_max_position_embeddings=scaling.int("original_max_position_embeddings"),
        beta_fast=scaling.float("beta_fast", 32.0),
        beta_slow=scaling.float("beta_slow", 1.0),
        mscale=scaling.float("mscale", 1.0, positive=False),
        mscale_all_dim=scaling.float("mscale_all_dim", 0.0, positive=False),
    )


def _glm4_moe(read: _ConfigReader) -> dict[str, Any]:
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


def _check_groups(fields: dict[str, Any]) -> None:
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


_FAMILY_READERS = {
    "Qwen3MoeForCausalLM": lambda read: _qwen_moe(read, qwen2=False),
    "Qwen2MoeForCausalLM": lambda read: _qwen_moe(read, qwen2=True),
    "MixtralForCausalLM": _mixtral,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "Glm4MoeForCausalLM": _glm4_moe,
}
