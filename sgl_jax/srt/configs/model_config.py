"""The model's configuration, normalised once from a Hugging Face checkpoint.

Model code never reads the raw HF ``config.json``: everything it needs is a field of the
frozen :class:`ModelConfig`, so a checkpoint that lacks a field or sets it to an unsupported
value fails here, at load time, with a message that names the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUNDLED_MODEL_PATH = str(Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-moe")

# HF architecture name -> our model family. The model registry maps these to classes.
SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


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
    """Qwen3-MoE's rule for which decoder layers have a router (the others are dense MLPs)."""
    return (
        layer_id not in mlp_only_layers
        and num_experts > 0
        and (layer_id + 1) % decoder_sparse_step == 0
    )


@dataclass(frozen=True)
class ModelConfig:
    model_path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # each expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
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

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)

    @staticmethod
    def from_hf(model_path: str | None = None, context_length: int | None = None) -> ModelConfig:
        path = resolve_model_path(model_path)
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"{path} has no config.json; it is not a Hugging Face checkpoint")
        with open(config_file, encoding="utf-8") as f:
            hf = json.load(f)
        return ModelConfig.from_dict(hf, path, context_length)

    @staticmethod
    def from_dict(
        hf: dict[str, Any], model_path: str, context_length: int | None = None
    ) -> ModelConfig:
        architectures = hf.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {architectures!r} in {model_path}/config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"{model_path}/config.json lacks the field {key!r}")
            return hf[key]

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(hf.get("num_key_value_heads", num_heads))
        hidden = int(need("hidden_size"))
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        num_experts = int(need("num_experts"))
        top_k = int(need("num_experts_per_tok"))
        sparse_step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = tuple(int(i) for i in hf.get("mlp_only_layers") or ())
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        if sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={sparse_step} must be >= 1")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise ValueError(f"rope_scaling {rope_scaling!r} is not supported yet")

        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = int(hf.get("max_position_embeddings", 2048))
        return ModelConfig(
            model_path=model_path,
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size", 0)),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=tuple(
                is_moe_layer(i, num_experts, sparse_step, mlp_only) for i in range(num_layers)
            ),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            context_len=int(context_length or max_pos),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            torch_dtype=str(hf.get("torch_dtype", "float32")),
        )
