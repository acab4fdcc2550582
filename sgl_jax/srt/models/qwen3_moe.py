"""Qwen3-MoE: GQA with q/k RMSNorm, softmax top-k routing, dense layers by
``decoder_sparse_step`` / ``mlp_only_layers`` (all in ``common.py``, set by ModelConfig)."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
