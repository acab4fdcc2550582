"""MiniMax-M2: every layer sparse; sigmoid routing with ``e_score_correction_bias`` held by the
MoE block (``sigmoid_grouped`` with one group, renormalised, unscaled); one RMSNorm over all
heads' q (k) before the split into heads (``qk_norm_type`` per_layer); rotary on the first
``rotary_dim`` dims of a head. Its MoE block is ``block_sparse_moe`` and an expert's gate, up
and down projections are ``w1``, ``w3`` and ``w2`` (as Mixtral). All in ``common.py``, set by
ModelConfig."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class MiniMaxM2ForCausalLM(MoeForCausalLM):
    moe_name = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")
