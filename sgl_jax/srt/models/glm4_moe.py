"""GLM-4.5 / GLM-4.5-Air: GQA with q/k/v biases (``attention_bias``), optional q/k norms
(``use_qk_norm``), partial rotary (``partial_rotary_factor``); DeepSeek-V3's router (grouped
sigmoid with the correction bias) and shared experts; the first ``first_k_dense_replace``
layers dense. All in ``common.py``, set by ModelConfig."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class Glm4MoeForCausalLM(MoeForCausalLM):
    pass
