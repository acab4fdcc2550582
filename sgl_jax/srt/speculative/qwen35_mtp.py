"""Qwen3.5-MoE's (and Qwen3-Next's) multi-token-prediction (MTP) layer as the NEXTN draft.

The checkpoint holds it under ``mtp.*`` (``config.json``: ``mtp_num_hidden_layers``, under
``text_config`` in the released form): ``fc`` ``[H, 2H]``, ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, one decoder layer ``layers.0`` of the family with gated full attention
(never Gated DeltaNet) and its MoE with the gated shared expert, and ``norm``; every norm is
Qwen3.5's ``x * (1 + w)``. No copy of the embedding or the LM head: the target's are used.

Draft position p, as the released model's serving code runs it (vLLM's ``qwen3_5_mtp`` /
``qwen3_next_mtp``): ``f_p`` is the target's hidden state at p *after* its final norm (what
the target's LM head reads), then
``z_p = fc([pre_fc_norm_embedding(embed(x_{p+1})), pre_fc_norm_hidden(f_p)])``,
``g_p = layer(z_p)``, logits ``norm(g_p) @ lm_head``; a chained draft step takes ``norm(g_p)``
as its ``f``. (DeepSeek-V3 / GLM-4.5's ``MtpDraft`` takes the un-normed states.) The layer's
routing is computed and dropped, as for every draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch_info import ForwardBatch
from sgl_jax.srt.layers.attention import AttentionMetadata
from sgl_jax.srt.layers.norm import RMSNormPlusOne
from sgl_jax.srt.models.backends import ModelBackends
from sgl_jax.srt.models.common import param
from sgl_jax.srt.models.qwen3_5_moe import Qwen35DecoderLayer


class Qwen35MtpDraft(nnx.Module):
    # The step gives it the target's hidden states after the final norm (``step_program``).
    reads_normed_hidden = True

    def __init__(self, config: ModelConfig, dtype: jnp.dtype) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        assert config.linear_layers == (False,), "the MTP layer is a full-attention layer"
        self.fc = param((2 * hidden, hidden), dtype, (None, None))
        self.pre_fc_norm_embedding = RMSNormPlusOne(hidden, eps, dtype)
        self.pre_fc_norm_hidden = RMSNormPlusOne(hidden, eps, dtype)
        self.layers = nnx.List([Qwen35DecoderLayer(config, 0, dtype)])
        self.norm = RMSNormPlusOne(hidden, eps, dtype)

    def output_norm(self, g: jax.Array) -> jax.Array:
        return self.norm(g)

    def chain_features(self, g: jax.Array) -> jax.Array:
        """A chained step's ``f``: the previous step's normed output."""
        return self.norm(g)

    def __call__(self, embedded: jax.Array, features: jax.Array, batch: ForwardBatch,
                 meta: AttentionMetadata, kv: jax.Array, backends: ModelBackends,
                 ) -> tuple[jax.Array, jax.Array]:
        z = jnp.concatenate([self.pre_fc_norm_embedding(embedded),
                             self.pre_fc_norm_hidden(features.astype(embedded.dtype))], axis=-1)
        g, kv, _ = self.layers[0](z @ self.fc[...], batch, meta, kv, backends)
        return g, kv
