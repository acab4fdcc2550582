"""Routers: one module per routing rule, each ``x [T, H] -> (weights [T, k] f32, ids [T, k])``.

Every router computes its logits in float32 (the weights are float32 whatever the model
dtype: routing must match a float32 reference bit for bit) and returns LOGICAL expert ids in
descending order of the score it selects by, ties to the lower id (``lax.top_k`` returns
equal values in index order). The rules (``ModelConfig.router``):

- ``softmax_topk`` (Qwen3-MoE, Qwen2-MoE): softmax over all experts, the k most probable,
  their probabilities renormalised to sum to 1 when ``norm_topk_prob``.
- ``topk_softmax`` (Mixtral; gpt-oss, whose logits add the router's ``bias``): the k largest
  logits, weights a softmax over those k (equal to softmax-then-renormalise, with the same
  order).
- ``sigmoid_grouped`` (DeepSeek-V3, GLM-4.5): sigmoid scores; the selection adds the per-expert
  ``e_score_correction_bias`` (load balancing without an auxiliary loss); experts form
  ``n_group`` groups, a group scores the sum of its two best corrected scores, only the
  ``topk_group`` best groups compete; the k best corrected scores win; their weights are the
  UNcorrected scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
  Experts of dropped groups are out of the race (-inf), as in DeepSeek's own inference code.
  MiniMax-M2 is this rule with one group, renormalised, unscaled.

Parameter paths follow Hugging Face: the router is the MoE block's ``gate`` module (gpt-oss:
``router``), so its tensors load from ``mlp.gate.weight`` (and
``mlp.gate.e_score_correction_bias``; MiniMax-M2 keeps that bias on the block itself,
``block_sparse_moe.e_score_correction_bias``: ``hf`` names starting with ``../`` are relative
to the block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig


def _router_weight(hidden: int, experts: int) -> nnx.Param:
    # [H, E] float32, replicated; Hugging Face stores [E, H] (transposed on load).
    return nnx.Param(jnp.zeros((hidden, experts), jnp.float32), out_sharding=(None, None),
                     eager_sharding=False, hf=("weight", True))


def _router_bias(hf_name: str, experts: int) -> nnx.Param:
    # [E] float32, replicated; ``hf_name`` relative to the router (``../``: to its block).
    return nnx.Param(jnp.zeros((experts,), jnp.float32), out_sharding=(None,),
                     eager_sharding=False, hf=(hf_name, False))


class SoftmaxTopKRouter(nnx.Module):
    def __init__(self, config: ModelConfig) -> None:
        self.weight = _router_weight(config.hidden_size, config.num_experts)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        probs = jax.nn.softmax(x.astype(jnp.float32) @ self.weight[...], axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids.astype(jnp.int32)


class TopKSoftmaxRouter(nnx.Module):
    def __init__(self, config: ModelConfig) -> None:
        self.weight = _router_weight(config.hidden_size, config.num_experts)
        self.top_k = config.num_experts_per_tok
        self.has_bias = config.router_bias
        if self.has_bias:
            self.bias = _router_bias("bias", config.num_experts)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = x.astype(jnp.float32) @ self.weight[...]
        if self.has_bias:
            logits = logits + self.bias[...]
        logits, ids = jax.lax.top_k(logits, self.top_k)
        return jax.nn.softmax(logits, axis=-1), ids.astype(jnp.int32)


class GroupedSigmoidRouter(nnx.Module):
    def __init__(self, config: ModelConfig) -> None:
        self.weight = _router_weight(config.hidden_size, config.num_experts)
        name = "e_score_correction_bias"
        self.e_score_correction_bias = _router_bias(
            f"../{name}" if config.score_bias_on_block else name, config.num_experts)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.weight[...])  # [T, E]
        choice = scores + self.e_score_correction_bias[...]
        if self.topk_group < self.n_group:
            tokens, experts = choice.shape
            grouped = choice.reshape(tokens, self.n_group, experts // self.n_group)
            best_two = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
            _, kept = jax.lax.top_k(jnp.sum(best_two, axis=-1), self.topk_group)  # [T, topk_group]
            in_kept = jnp.any(kept[:, :, None] == jnp.arange(self.n_group)[None, None, :], axis=1)
            expert_kept = jnp.repeat(in_kept, experts // self.n_group, axis=1)
            choice = jnp.where(expert_kept, choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if self.renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.scaling, ids.astype(jnp.int32)


ROUTER_MODULES: dict[str, type[nnx.Module]] = {
    "softmax_topk": SoftmaxTopKRouter,
    "topk_softmax": TopKSoftmaxRouter,
    "sigmoid_grouped": GroupedSigmoidRouter,
}


def create_router(config: ModelConfig) -> nnx.Module:
    return ROUTER_MODULES[config.router](config)
