"""tunix's Qwen3 model (``tunix.models.qwen3``) next to ours: its config from a checkpoint we
serve, and its weights under the Hugging Face names the engine's weight updates take.

tunix's Qwen3-MoE differs from the Hugging Face model in three ways (tunix 0.1.7): it always
renormalises the top-k routing weights (``norm_topk_prob``), its attention applies RoPE with
theta 1e6 whatever ``rope_theta`` says, and every layer is an MoE layer (no
``mlp_only_layers``). A checkpoint that needs any of these would train one model in tunix and
serve another in the engine, so ``tunix_qwen3_config`` refuses it with a ValueError.

Routing replay (:mod:`sgl_jax.integrations.tunix_qwen3_replay`, re-exported here):
``ReplayQwen3`` (tunix's Qwen3 whose ``__call__`` takes ``forced_routed_experts=``) and
``replayed_per_token_logps`` (tunix's per-token logprobs under the rollout's routing).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from flax import nnx
from tunix.models.qwen3 import model as qwen3_lib

from sgl_jax.integrations.tunix_qwen3_replay import ReplayQwen3, replayed_per_token_logps
from sgl_jax.srt.configs.model_config import ModelConfig, resolve_model_path

__all__ = [
    "ReplayQwen3",
    "hf_arrays_from_tunix_qwen3",
    "replayed_per_token_logps",
    "tunix_qwen3_config",
]

_TUNIX_ROPE_THETA = 1_000_000  # tunix.models.qwen3.model.apply_rope's default, always used


def tunix_qwen3_config(model_path: str | None = None) -> qwen3_lib.ModelConfig:
    """tunix's ``ModelConfig`` of the Qwen3-MoE checkpoint at ``model_path`` (None: the
    bundled model), for ``tunix.models.qwen3.params.create_model_from_safe_tensors``.

    ValueError if tunix's model would compute something else than the checkpoint's."""
    cfg = ModelConfig.from_hf(resolve_model_path(model_path))
    problems = []
    if cfg.architecture != "Qwen3MoeForCausalLM":
        problems.append(f"architecture {cfg.architecture} (tunix's model is Qwen3MoeForCausalLM)")
    if not cfg.norm_topk_prob:
        problems.append("norm_topk_prob is false (tunix always renormalises the top-k weights)")
    if cfg.rope_theta != _TUNIX_ROPE_THETA:
        problems.append(f"rope_theta {cfg.rope_theta:g} (tunix's attention uses 1e6)")
    if cfg.rope_scaling is not None:
        problems.append("rope_scaling is set (tunix has none)")
    if not all(cfg.moe_layers):
        problems.append("some layers are dense (mlp_only_layers / decoder_sparse_step)")
    if problems:
        raise ValueError(f"{cfg.model_path}: tunix's Qwen3 cannot be this model: "
                         + "; ".join(problems))
    return qwen3_lib.ModelConfig(
        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size, hidden_dim=cfg.moe_intermediate_size,
        num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads, rope_theta=_TUNIX_ROPE_THETA,
        norm_eps=cfg.rms_norm_eps, use_tied_embedding=cfg.tie_word_embeddings,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
    )


# -- weights ---------------------------------------------------------------------------------
# Each rule: tunix's parameter path (dotted), the Hugging Face name it becomes (``\N`` are the
# path's groups) and the layout change. tunix keeps kernels as [in, out] (heads split out of
# the projections) and experts stacked [E, in, out]; Hugging Face keeps every weight [out, in]
# and one tensor per expert. All layout changes are JAX ops: on device, no host copy.
Layout = Callable[[jax.Array], jax.Array]


def _same(x: jax.Array) -> jax.Array:
    return x


def _transposed(x: jax.Array) -> jax.Array:
    return x.T


def _heads_in(x: jax.Array) -> jax.Array:  # q/k/v [D, heads, head_dim] -> [heads*head_dim, D]
    return x.reshape(x.shape[0], -1).T


def _heads_out(x: jax.Array) -> jax.Array:  # o [heads, head_dim, D] -> [D, heads*head_dim]
    return x.reshape(-1, x.shape[-1]).T


_LAYER, _HF_LAYER = r"layers\.(\d+)\.", r"model.layers.\1."
_RULES: tuple[tuple[re.Pattern[str], str, Layout], ...] = tuple(
    (re.compile(pattern), name, layout) for pattern, name, layout in (
        (r"embedder\.input_embedding", "model.embed_tokens.weight", _same),
        (r"final_norm\.w", "model.norm.weight", _same),
        (r"lm_head\.w", "lm_head.weight", _transposed),
        (_LAYER + r"attn\.([qkv])_proj\.w", _HF_LAYER + r"self_attn.\2_proj.weight", _heads_in),
        (_LAYER + r"attn\.o_proj\.w", _HF_LAYER + "self_attn.o_proj.weight", _heads_out),
        (_LAYER + r"attn\.([qk])_norm\.w", _HF_LAYER + r"self_attn.\2_norm.weight", _same),
        (_LAYER + r"(input_layernorm|post_attention_layernorm)\.w", _HF_LAYER + r"\2.weight",
         _same),
        (_LAYER + r"mlp\.router\.kernel", _HF_LAYER + "mlp.gate.weight", _transposed),
    ))
# Stacked experts [E, in, out]: one [out, in] tensor per expert.
_EXPERTS = re.compile(_LAYER + r"mlp\.(gate|up|down)_proj")


def hf_arrays_from_tunix_qwen3(state: Mapping[Any, Any]) -> dict[str, jax.Array]:
    """The parameters of a tunix Qwen3(-MoE) model (``nnx.state(model, nnx.Param)``, or the
    same tree as plain nested dicts of arrays) as Hugging Face tensors by name, what
    ``Engine.update_weights_from_arrays`` takes.

    One jitted program on the parameters' devices (compiled once per model shape): nothing
    crosses to the host, which tunix's weight sync forbids on CPU. ValueError naming the first
    parameter no rule knows (a LoRA adapter, another model)."""
    flat = {}
    for dotted, var in _flat(state, ""):
        if _EXPERTS.fullmatch(dotted) is None and _rule(dotted) is None:
            raise ValueError(
                f"tunix parameter {dotted!r} has no Hugging Face name here (tunix's Qwen3-MoE "
                "parameters are mapped; merge LoRA adapters into the base weights first)")
        flat[dotted] = var.get_value() if isinstance(var, nnx.Variable) else var
    return _to_hf(flat)


def _flat(tree: Mapping[Any, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) of a nested mapping (an ``nnx.State`` is one)."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat(value, path + ".")
        else:
            yield path, value


def _rule(dotted: str) -> tuple[str, Layout] | None:
    for pattern, name, layout in _RULES:
        match = pattern.fullmatch(dotted)
        if match is not None:
            return match.expand(name), layout
    return None


@jax.jit
def _to_hf(flat: dict[str, jax.Array]) -> dict[str, jax.Array]:
    out: dict[str, jax.Array] = {}
    for dotted, value in flat.items():
        experts = _EXPERTS.fullmatch(dotted)
        if experts is None:
            name, layout = _rule(dotted)
            out[name] = layout(value)
            continue
        layer, proj = experts.groups()
        for e in range(value.shape[0]):
            out[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = value[e].T
    return out
