"""Mixtral: every layer sparse, top-k over the router logits with a softmax over the k
selected (``topk_softmax``); the MoE block is ``block_sparse_moe`` and an expert's gate, up
and down projections are ``w1``, ``w3`` and ``w2``."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    moe_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
