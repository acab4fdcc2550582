"""What a model's forward is traced with besides its inputs, chosen once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_jax.srt.layers.attention import AttentionBackend
from sgl_jax.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer


@dataclass(frozen=True)
class ModelBackends:
    attention: AttentionBackend  # --attention-backend
    moe: str  # --moe-backend, resolved: "dense" or "ragged"
    # The runner's own capturer: MoE layers record their top-k ids with it while traced.
    capturer: RoutedExpertsCapturer
    # --enable-deterministic-inference: no computation of a row may depend on the batch's
    # other rows beyond the (fixed) padded shape.
    batch_invariant: bool = False
