"""DeepSeek-V3: multi-head latent attention (MLA) on the shared MoE decoder of ``common.py``
(grouped-sigmoid routing with a correction bias, shared experts, dense first layers).

MLA, per token (HF names of ``self_attn``):

- query: ``q_b_proj(rms(q_a_proj(x), q_a_layernorm))`` (or ``q_proj(x)`` when q_lora_rank is
  None) -> per head ``(q_nope [qk_nope], q_rope [qk_rope])``;
- ``kv_a_proj_with_mqa(x)`` -> ``(c [kv_lora_rank], k_rope [qk_rope])``, c normalised by
  ``kv_a_layernorm``; k_rope is one key part shared by all heads;
- ``kv_b_proj(c)`` -> per head ``(k_nope [qk_nope], v [v_head])``, i.e. ``W_UK`` and ``W_UV``;
- scores ``q_nope . k_nope + q_rope . k_rope`` (RoPE, interleaved pairs by default, YaRN when
  configured, on q_rope and k_rope) times ``(qk_nope + qk_rope)^-0.5 * softmax_mscale^2``;
  output per head ``sum p v``, then ``o_proj``.

The KV cache holds only the latent row ``concat(c, roped k_rope)`` per token
(``[pages, page_size, 1, kv_lora_rank + qk_rope]``, replicated over the mesh). Attention is
computed in latent space with the weights absorbed, for prefill and decode alike (one path; no
separate non-absorbed prefill): ``q_nope @ W_UK`` per head gives a latent query ``[kv_lora]``,
so ``q_nope . k_nope = (q_nope W_UK) . c``; the query ``concat(q_nope W_UK, q_rope)`` attends
over the cached rows (``AttentionBackend.attend_latent``) with values their first kv_lora dims
(``c``), and the per-head result ``sum p c`` is mapped out by ``W_UV`` (``(sum p c) W_UV =
sum p v``). Under tensor parallelism the heads split over the "tensor" axis: q_b_proj / q_proj
and kv_b_proj on their output dim, o_proj on its input dim; the down projections, the norms
and the latent cache are replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata, write_latent
from sgl_jax.srt.layers.attention.data_parallel import rank_local_attention
from sgl_jax.srt.layers.norm import RMSNorm
from sgl_jax.srt.layers.rotary import apply_rotary
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import MoeForCausalLM, param

# The latent norms (q_a_layernorm, kv_a_layernorm) use a fixed epsilon whatever rms_norm_eps
# says, in DeepSeek's own inference code and in transformers alike.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: ModelConfig) -> float:
    """``(qk_nope + qk_rope)^-0.5``, times ``softmax_mscale^2`` under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if config.rope_scaling is not None:
        scale *= config.rope_scaling.softmax_mscale**2
    return scale


class MlaAttention(nnx.Module):
    """Multi-head latent attention with absorbed weights over a latent KV cache (module
    docstring). Interface as ``common.GqaAttention``."""

    def __init__(self, config: ModelConfig, dtype: jnp.dtype, layer_id: int = 0) -> None:
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.q_lora = config.q_lora_rank
        self.rope_theta = config.rope_theta
        self.interleaved = config.rope_interleaved
        self.yarn = config.rope_scaling
        self.scale = mla_softmax_scale(config)
        q_out = heads * (self.nope + self.rope)
        if self.q_lora is None:
            self.q_proj = param((hidden, q_out), dtype, (None, "tensor"))
        else:
            self.q_a_proj = param((hidden, self.q_lora), dtype, (None, None))
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS, dtype)
            self.q_b_proj = param((self.q_lora, q_out), dtype, (None, "tensor"))
        self.kv_a_proj_with_mqa = param((hidden, self.kv_lora + self.rope), dtype, (None, None))
        self.kv_a_layernorm = RMSNorm(self.kv_lora, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = param((self.kv_lora, heads * (self.nope + self.v_dim)), dtype,
                               (None, "tensor"))
        self.o_proj = param((heads * self.v_dim, hidden), dtype, ("tensor", None))

    def _rotary(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rotary(x, positions, self.rope_theta, self.rope,
                            interleaved=self.interleaved, yarn=self.yarn)

    def __call__(
        self, x: jax.Array, batch: ForwardBatch, meta: AttentionMetadata, kv: jax.Array,
        backends: ModelBackends,
    ) -> tuple[jax.Array, jax.Array]:
        tokens = x.shape[0]
        if self.q_lora is None:
            q = x @ self.q_proj[...]
        else:
            q = self.q_a_layernorm(x @ self.q_a_proj[...]) @ self.q_b_proj[...]
        q = q.reshape(tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        q_rope = self._rotary(q_rope, meta.positions)

        ckv = x @ self.kv_a_proj_with_mqa[...]
        c = self.kv_a_layernorm(ckv[:, : self.kv_lora])
        k_rope = self._rotary(ckv[:, None, self.kv_lora :], meta.positions)[:, 0]
        latent_rows = jnp.concatenate([c, k_rope], axis=-1)
        if not backends.dp_attention:
            # Write first, then read prefix and new rows from the written cache (in place).
            kv = write_latent(kv, latent_rows, batch.out_cache_loc)

        # kv_b_proj [kv_lora, H * (nope + v)]: per head W_UK [kv_lora, nope], W_UV [kv_lora, v].
        w_kv_b = self.kv_b_proj[...].reshape(self.kv_lora, self.num_heads, self.nope + self.v_dim)
        w_uk, w_uv = w_kv_b[..., : self.nope], w_kv_b[..., self.nope :]
        q_latent = jnp.einsum("thn,chn->thc", q_nope, w_uk)  # [T, H, kv_lora]
        q_full = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
        if backends.dp_attention:  # the same, per attention rank on its shard of the cache
            def write_and_attend(q: jax.Array, rows: jax.Array, kv: jax.Array,
                                 slots: jax.Array, meta: AttentionMetadata
                                 ) -> tuple[jax.Array, jax.Array]:
                kv = write_latent(kv, rows, slots)
                return backends.attention.attend_latent(q, kv, meta, self.scale, self.kv_lora), kv

            o_latent, kv = rank_local_attention(
                write_and_attend, q_full, latent_rows, kv, batch.out_cache_loc, meta,
                heads_split=True, cache_heads_split=False)
        else:
            o_latent = backends.attention.attend_latent(q_full, kv, meta, self.scale, self.kv_lora)
        out = jnp.einsum("thc,chv->thv", o_latent.astype(w_uv.dtype), w_uv)  # [T, H, v_head]
        return out.reshape(tokens, -1) @ self.o_proj[...], kv


class DeepseekV3ForCausalLM(MoeForCausalLM):
    attention_cls = MlaAttention
