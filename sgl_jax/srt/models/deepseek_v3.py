"""DeepSeek-V3 (placeholder until MLA lands): grouped-sigmoid routing and shared experts
from ``common.py``; multi-head latent attention is added here."""

from __future__ import annotations

from sgl_jax.srt.models.common import MoeForCausalLM


class DeepseekV3ForCausalLM(MoeForCausalLM):
    pass
