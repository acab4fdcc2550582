"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``; the released ``Qwen3_5MoeForConditionalGeneration``'s
language model): hybrid layers, ``config.linear_layers[i]`` choosing a Gated DeltaNet mixer
(``gated_deltanet.py``) or gated full attention (:class:`GatedAttention`); every layer MoE,
softmax top-k always renormalised plus one shared expert scaled by sigmoid(shared_expert_gate)
(``common.SparseMoeBlock`` with the config's router and gated shared expert); every decoder,
final and q/k RMSNorm computes ``x * (1 + w)`` (``RMSNormPlusOne``).

The step's ``kv_caches`` list has one entry per layer: a full-attention layer's paged KV array,
a linear layer's pair of state tables (conv, recurrent) (``model_executor/linear_state.py``).
Checkpoint names: ``model.layers.*`` as here; the released form's ``model.language_model.*``,
its vision tower and MTP layers are mapped by ``model_loader/qwen35_names.py``. The MTP layer
(``mtp.*``) is NEXTN's draft (``speculative/qwen35_mtp.py``: one ``Qwen35DecoderLayer`` of
gated attention); in a verify step the linear layers keep their states after the accepted
tokens only (``layers/linear_attention/verify.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata, write_kv
from sgl_jax.srt.layers.moe.routing import LayerRouting
from sgl_jax.srt.layers.norm import RMSNormPlusOne
from sgl_jax.srt.layers.rotary import apply_rotary
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import MoeForCausalLM, SparseMoeBlock, param, run_layers
from sgl_jax.srt.models.gated_deltanet import GatedDeltaNet


class GatedAttention(nnx.Module):
    """GQA whose ``q_proj`` gives, per head, ``[query | gate]`` (``attn_output_gate``): the
    attention output (heads concatenated) is multiplied by sigmoid(gate) before ``o_proj``.
    q and k get a (1 + w) RMSNorm per head, then rotate-half RoPE on their first
    ``rotary_dim`` dims. Under --tp-size it splits by head over "tensor" like
    ``common.Attention`` (a head's query and gate columns are adjacent in ``q_proj``, so a
    contiguous column block is whole heads)."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        hidden, heads, kv_heads, hd = (config.hidden_size, config.num_attention_heads,
                                       config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, hd
        self.rope_theta, self.rotary_dim = config.rope_theta, config.rope_dim
        self.q_proj = param((hidden, heads * 2 * hd), dtype, (None, "tensor"))
        self.k_proj = param((hidden, kv_heads * hd), dtype, (None, "tensor"))
        self.v_proj = param((hidden, kv_heads * hd), dtype, (None, "tensor"))
        self.o_proj = param((heads * hd, hidden), dtype, ("tensor", None))
        self.has_bias = config.qkv_bias
        if self.has_bias:
            self.q_proj_bias = param((heads * 2 * hd,), dtype, ("tensor",), ("q_proj.bias", False))
            self.k_proj_bias = param((kv_heads * hd,), dtype, ("tensor",), ("k_proj.bias", False))
            self.v_proj_bias = param((kv_heads * hd,), dtype, ("tensor",), ("v_proj.bias", False))
            self.o_proj_bias = param((hidden,), dtype, (None,), ("o_proj.bias", False))
        self.q_norm = RMSNormPlusOne(hd, config.rms_norm_eps, dtype)
        self.k_norm = RMSNormPlusOne(hd, config.rms_norm_eps, dtype)

    def __call__(self, x: jax.Array, batch: ForwardBatch, meta: AttentionMetadata,
                 kv: jax.Array, backends: ModelBackends) -> tuple[jax.Array, jax.Array]:
        t, hd = x.shape[0], self.head_dim
        qg, k, v = (x @ getattr(self, n)[...] for n in ("q_proj", "k_proj", "v_proj"))
        if self.has_bias:
            qg, k, v = qg + self.q_proj_bias[...], k + self.k_proj_bias[...], v + self.v_proj_bias[...]
        qg = qg.reshape(t, self.num_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, self.num_heads * hd)
        q = apply_rotary(self.q_norm(q), meta.positions, self.rope_theta, self.rotary_dim)
        k = apply_rotary(self.k_norm(k.reshape(t, self.num_kv_heads, hd)), meta.positions,
                         self.rope_theta, self.rotary_dim)
        v = v.reshape(t, self.num_kv_heads, hd)
        # Write first, then attend over the written cache (in place on the donated cache).
        kv = write_kv(kv, k, v, batch.out_cache_loc)
        out = backends.attention.attend(q, kv, meta, hd ** -0.5).reshape(t, -1)
        out = (out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)) @ self.o_proj[...]
        if self.has_bias:
            out = out + self.o_proj_bias[...]
        return out, kv


class Qwen35DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: jnp.dtype) -> None:
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNormPlusOne(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNormPlusOne(config.hidden_size, eps, dtype)
        self.is_linear = config.linear_layers[layer_id]
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, dtype)
        else:
            self.self_attn = GatedAttention(config, dtype)
        self.mlp = SparseMoeBlock(config, layer_id, dtype)

    def __call__(self, h: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, cache: Any,
                 backends: ModelBackends) -> tuple[jax.Array, Any, LayerRouting]:
        x = self.input_layernorm(h)
        if self.is_linear:
            width = backends.verify_width if batch.forward_mode.is_verify else 0
            out, cache = self.linear_attn(x, batch.req_pool_indices, meta, cache, width)
        else:
            out, cache = self.self_attn(x, batch, meta, cache, backends)
        h = h + out
        out, routing = self.mlp(self.post_attention_layernorm(h), backends)
        return h + out, cache, routing


class Qwen35Model(nnx.Module):
    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        self.embed_tokens = param((config.vocab_size, config.hidden_size), dtype, (None, None))
        self.layers = nnx.List([Qwen35DecoderLayer(config, i, dtype)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNormPlusOne(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, batch: ForwardBatch, meta: AttentionMetadata, caches: list,
                 backends: ModelBackends) -> tuple[jax.Array, list, list[LayerRouting]]:
        if backends.dp_attention:  # refused at start-up (model_executor/linear_state.py)
            raise ValueError("Qwen3.5-MoE does not run with --enable-dp-attention")
        h = jnp.take(self.embed_tokens[...], batch.input_ids, axis=0)
        return run_layers(self.layers, h, batch, meta, caches, backends)


class Qwen3_5MoeForCausalLM(MoeForCausalLM):  # noqa: N801 (the Hugging Face class name)
    """The logits, routing and hidden-state outputs are ``MoeForCausalLM.__call__``'s."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        self.config = config
        self.model = Qwen35Model(config, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = param((config.hidden_size, config.vocab_size), dtype, (None, None))


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):  # noqa: N801
    """The released form: the same language model (names mapped at load)."""
