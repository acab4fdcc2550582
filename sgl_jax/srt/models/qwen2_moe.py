"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): GQA with q/k/v biases, softmax top-k routing
(usually without renormalisation) and one shared expert scaled by ``sigmoid(x @
shared_expert_gate)``; all in ``common.py``, set by ModelConfig."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass
