"""gpt-oss: GQA with q/k/v/o biases, attention sinks, sliding-window attention on the layers
``layer_types`` names and YaRN (all in ``common.GqaAttention``, set by ModelConfig); a router
with a bias (``topk_softmax`` over the biased logits); experts with biases and a clamped
SwiGLU (:class:`GptOssMoeBlock`).

Experts. Hugging Face holds them fused: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (gate in
the even columns, up in the odd ones), ``gate_up_proj_bias`` ``[E, 2I]``, ``down_proj``
``[E, I, H]``, ``down_proj_bias`` ``[E, H]`` (the released MXFP4 checkpoints: ``*_blocks`` and
``*_scales`` instead of the two weights, dequantised at load: ``model_loader/fused_experts``).
Here the gate/up biases become one more input row of the stacked weights, ``w_gate`` /
``w_up`` ``[E, H + 1, I]`` (row H is the bias), and the experts read ``[x, 1]``: every expert
backend (dense, ragged, gmm) and every placement (EP, EPLB, DP attention's dispatch) then
computes ``x @ W + b`` unchanged, with no per-step bias gather. The down bias is added after
the experts, ``sum_j w_j * down_bias[id_j]`` over a token's k experts (weights by logical id,
replicated: ``[E, H]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.layers.moe.activation import ExpertActivation
from sgl_jax.srt.layers.moe.ep_moe import W_DOWN_SPEC, W_GATE_UP_SPEC
from sgl_jax.srt.layers.moe.experts import MoEBackend
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import MoeForCausalLM, SparseMoeBlock, param


class GptOssMoeBlock(SparseMoeBlock):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 router_name: str = "router") -> None:
        super().__init__(config, layer_id, dtype, expert_names, router_name)
        hidden, experts = config.hidden_size, config.num_physical_experts
        inter = config.moe_intermediate_size
        # Replaces the plain [E, H, I] stacks: the loader builds these from the fused tensors
        # (``fused``: which part of which HF tensor), experts in the layer's physical order.
        self.w_gate = param((experts, hidden + 1, inter), dtype, W_GATE_UP_SPEC,
                            fused=("gate_up_proj", "gate"))
        self.w_up = param((experts, hidden + 1, inter), dtype, W_GATE_UP_SPEC,
                          fused=("gate_up_proj", "up"))
        self.w_down = param((experts, inter, hidden), dtype, W_DOWN_SPEC,
                            fused=("down_proj", "down"))
        self.down_bias = param((config.num_experts, hidden), dtype, (None, None),
                               ("experts.down_proj_bias", False))
        self.activation = ExpertActivation("clamped_swiglu", config.swiglu_limit,
                                           config.swiglu_alpha)

    def expert_input(self, x: jax.Array) -> jax.Array:
        return jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype)], axis=1)

    def expert_backend(self, backends: ModelBackends) -> MoEBackend:
        return backends.moe.with_activation(self.activation)

    def expert_output(self, out: jax.Array, topk_ids: jax.Array,
                      topk_weights: jax.Array) -> jax.Array:
        bias = jnp.take(self.down_bias[...], topk_ids, axis=0).astype(jnp.float32)  # [T, k, H]
        added = jnp.einsum("tk,tkh->th", topk_weights.astype(jnp.float32), bias)
        return (out.astype(jnp.float32) + added).astype(out.dtype)


class GptOssForCausalLM(MoeForCausalLM):
    moe_cls = GptOssMoeBlock
    router_name = "router"
