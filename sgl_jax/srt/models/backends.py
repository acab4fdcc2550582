"""What a model's forward is traced with besides its inputs, chosen once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from sgl_jax.srt.layers.attention import AttentionBackend
from sgl_jax.srt.layers.moe.dispatch import RaggedAllToAll
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
    # --moe-dispatch ragged_all_to_all (with DP attention): the collective that sends each
    # assignment to its expert's device (layers/moe/dispatch.py); None: all-gather dispatch.
    moe_all_to_all: RaggedAllToAll | None = None
    # Sequence parallelism: a step of at least this many tokens keeps its residual stream
    # (and the norms, residual adds and router on it) split by token over the "tensor" axis
    # between the layers' projections; 0: never (models/sequence_parallel.py).
    sequence_parallel_tokens: int = 0
    # Compiled for TPU: lookups of the step's T * k assignments in small tables (a static
    # expert order, EPLB's replicas) by one-hot matmuls; XLA:TPU runs a gather from such a
    # table at a whole tile per element (layers/moe/ep_moe.lookup_rows). Off TPU: gathers,
    # the cheaper there. The runner gives the expert distribution recorder the same choice
    # for its counts (one-hot compares, not a scatter-add).
    one_hot_lookups: bool = False
    # Speculative decoding: the most tokens a row brings to a verify step (its last token and
    # its drafts); a linear-attention layer scans that many positions (0: no verify steps).
    verify_width: int = 0
