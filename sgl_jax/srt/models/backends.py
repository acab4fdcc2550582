"""What a model's forward is traced with besides its inputs, chosen once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_jax.srt.layers.attention import AttentionBackend
from sgl_jax.srt.layers.moe.experts import MoEBackend
from sgl_jax.srt.layers.moe.routing import RoutingSpec


@dataclass(frozen=True)
class ModelBackends:
    attention: AttentionBackend  # --attention-backend
    moe: MoEBackend  # --moe-backend, resolved: "dense" or "ragged"
    # The routing the forward outputs for its consumers (routed-experts capture, the expert
    # distribution recorder); the default, nothing, adds no op to the step.
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    # --enable-deterministic-inference: no computation of a row may depend on the batch's
    # other rows beyond the (fixed) padded shape.
    batch_invariant: bool = False
    # --enable-dp-attention: a step's rows and tokens are split over the "expert" mesh axis
    # (the attention ranks); attention runs per rank on its shard of the KV cache and the
    # MoE gathers the tokens to the experts' owners and scatters the results back.
    dp_attention: bool = False
