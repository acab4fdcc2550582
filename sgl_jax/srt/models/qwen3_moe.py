"""Qwen3-MoE in Flax NNX.

Parameter paths mirror the Hugging Face names (``model.layers.3.self_attn.q_proj``), with two
differences that the loader handles: linear weights are stored ``[in, out]`` (so the forward is
``x @ w``), and the experts of a layer are stacked into ``w_gate`` / ``w_up`` ``[E, H, I]`` and
``w_down`` ``[E, I, H]``. Every parameter carries a partition spec over the mesh axes
``expert`` and ``tensor``; with a 1-device mesh they are all trivially replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata, write_kv
from sgl_jax.srt.layers.moe.ep_moe import W_DOWN_SPEC, W_GATE_UP_SPEC, ep_moe_forward
from sgl_jax.srt.layers.moe.topk import select_experts
from sgl_jax.srt.layers.norm import RMSNorm
from sgl_jax.srt.layers.rotary import apply_rotary
from sgl_jax.srt.models.backends import ModelBackends

KVCache = list[jax.Array]  # per layer: [pages, page_size, 2 * kv_heads, head_dim] (attention/base.py)


def _param(shape: tuple[int, ...], dtype: jnp.dtype, sharding: tuple[str | None, ...]) -> nnx.Param:
    # Values are placeholders: the model is built under nnx.eval_shape and the loader fills it.
    return nnx.Param(jnp.zeros(shape, dtype=dtype), out_sharding=sharding, eager_sharding=False)


class Qwen3MoeAttention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope_theta = config.rope_theta
        self.q_proj = _param((hidden, heads * head_dim), dtype, (None, "tensor"))
        self.k_proj = _param((hidden, kv_heads * head_dim), dtype, (None, "tensor"))
        self.v_proj = _param((hidden, kv_heads * head_dim), dtype, (None, "tensor"))
        self.o_proj = _param((heads * head_dim, hidden), dtype, ("tensor", None))
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)

    def __call__(
        self, x: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, kv: jax.Array,
        backends: ModelBackends,
    ) -> tuple[jax.Array, jax.Array]:
        t = x.shape[0]
        q = (x @ self.q_proj[...]).reshape(t, self.num_heads, self.head_dim)
        k = (x @ self.k_proj[...]).reshape(t, self.num_kv_heads, self.head_dim)
        v = (x @ self.v_proj[...]).reshape(t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(self.q_norm(q), meta.positions, self.rope_theta)
        k = apply_rotary(self.k_norm(k), meta.positions, self.rope_theta)
        # Write first, then read everything (prefix and new tokens) from the written cache:
        # the reads depend on the scatter, so XLA updates the donated cache in place.
        kv = write_kv(kv, k, v, batch.out_cache_loc)
        out = backends.attention.attend(q, kv, meta, self.head_dim**-0.5)
        return out.reshape(t, -1) @ self.o_proj[...], kv


class Qwen3MoeMLP(nnx.Module):
    """Dense SwiGLU MLP of the layers without a router."""

    def __init__(self, hidden: int, intermediate: int, dtype: jnp.dtype) -> None:
        self.gate_proj = _param((hidden, intermediate), dtype, (None, "tensor"))
        self.up_proj = _param((hidden, intermediate), dtype, (None, "tensor"))
        self.down_proj = _param((intermediate, hidden), dtype, ("tensor", None))

    def __call__(self, x: jax.Array, backends: ModelBackends) -> jax.Array:
        act = jax.nn.silu(x @ self.gate_proj[...]) * (x @ self.up_proj[...])
        return act @ self.down_proj[...]


class Qwen3MoeSparseMoeBlock(nnx.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype) -> None:
        hidden, experts, inter = (
            config.hidden_size, config.num_experts, config.moe_intermediate_size,
        )
        self.layer_id = layer_id
        self.num_experts = experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # The router stays float32 whatever the model dtype: routing must match a float32
        # reference bit for bit.
        self.gate = _param((hidden, experts), jnp.float32, (None, None))
        # Stacked experts in the layer's physical order (ep_moe.py): row i holds logical
        # expert expert_order[i], and the rows of expert-axis device d are mapping[d]. The
        # loader sets the order it stacked them in; default: identity (contiguous mapping).
        self.w_gate = _param((experts, hidden, inter), dtype, W_GATE_UP_SPEC)
        self.w_up = _param((experts, hidden, inter), dtype, W_GATE_UP_SPEC)
        self.w_down = _param((experts, inter, hidden), dtype, W_DOWN_SPEC)
        self.expert_order: tuple[int, ...] = tuple(range(experts))

    def __call__(self, x: jax.Array, backends: ModelBackends) -> jax.Array:
        router_logits = x.astype(jnp.float32) @ self.gate[...]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        # Logical ids, captured once, before any device-expert mapping is applied.
        backends.capturer.capture(self.layer_id, topk_ids, topk_weights)
        return ep_moe_forward(
            x, topk_ids, topk_weights, self.w_gate[...], self.w_up[...], self.w_down[...],
            self.expert_order, backend=backends.moe,
        )


class Qwen3MoeDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype) -> None:
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Qwen3MoeAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.moe_layers[layer_id]:
            self.mlp = Qwen3MoeSparseMoeBlock(config, layer_id, dtype)
        else:
            self.mlp = Qwen3MoeMLP(config.hidden_size, config.intermediate_size, dtype)

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, kv: jax.Array,
        backends: ModelBackends,
    ) -> tuple[jax.Array, jax.Array]:
        attn_out, kv = self.self_attn(self.input_layernorm(h), batch, meta, kv, backends)
        h = h + attn_out
        h = h + self.mlp(self.post_attention_layernorm(h), backends)
        return h, kv


class Qwen3MoeModel(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        self.embed_tokens = _param((config.vocab_size, config.hidden_size), dtype, (None, None))
        self.layers = nnx.List(
            [Qwen3MoeDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_caches: KVCache,
        backends: ModelBackends,
    ) -> tuple[jax.Array, KVCache]:
        h = jnp.take(self.embed_tokens[...], batch.input_ids, axis=0)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h, kv = layer(h, batch, meta, kv, backends)
            new_caches.append(kv)
        return h, new_caches


class Qwen3MoeForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        self.config = config
        self.model = Qwen3MoeModel(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param((config.hidden_size, config.vocab_size), dtype, (None, "tensor"))

    def __call__(
        self, batch: ForwardBatch, meta: AttentionMetadata, kv_caches: KVCache,
        backends: ModelBackends,
    ) -> tuple[jax.Array, KVCache]:
        """Returns float32 logits ``[len(batch.logits_indices), vocab]``: each row's last new
        token, then any input-logprob tokens."""
        h, kv_caches = self.model(batch, meta, kv_caches, backends)
        head = self.model.embed_tokens[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        indices = batch.logits_indices
        rows = batch.batch_size
        if backends.batch_invariant and indices.shape[0] > rows:
            # The sampled rows keep their shapes (norm and LM head) whether or not a batch-mate
            # asked for input logprobs (the extra rows): kernels depend on the row count.
            parts = [self.model.norm(jnp.take(h, ix, axis=0)) @ head
                     for ix in (indices[:rows], indices[rows:])]
            logits = jnp.concatenate(parts)
        else:
            logits = self.model.norm(jnp.take(h, indices, axis=0)) @ head
        return logits.astype(jnp.float32), kv_caches
