"""tunix integration (Google's JAX post-training library, the ``tunix`` extra).

- ``SglJaxRollout``: the engine as tunix's rollout, ``ClusterConfig(rollout_engine=
  SglJaxRollout)`` (:mod:`sgl_jax.integrations.tunix_rollout`). Needs tunix: imported on first
  use, an ImportError naming the extra without it.
- ``align_routed_experts``, ``to_maxtext_forced_routed_experts``, ``UNSET_ROUTED_EXPERT``: the
  engine's routed experts in the layouts JAX trainers replay (tunix's ``[B, prompt_width +
  completion_width, L, k]``, MaxText's ``forced_routed_experts``); numpy only, no tunix needed
  (:mod:`sgl_jax.integrations.routing_replay`).

The trainer side of routing replay for tunix's Qwen3-MoE is in
:mod:`sgl_jax.integrations.tunix_qwen3` (``ReplayQwen3``, ``replayed_per_token_logps``) and
:mod:`sgl_jax.integrations.tunix_grpo` (``ReplayGRPOLearner``). docs/rl_rollouts.md walks
through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl_jax.integrations.routing_replay import (
    UNSET_ROUTED_EXPERT,
    align_routed_experts,
    to_maxtext_forced_routed_experts,
)

if TYPE_CHECKING:
    from sgl_jax.integrations.tunix_rollout import SglJaxRollout

__all__ = [
    "UNSET_ROUTED_EXPERT",
    "SglJaxRollout",
    "align_routed_experts",
    "to_maxtext_forced_routed_experts",
]


def __getattr__(name: str) -> Any:
    # The rollout imports tunix (and the engine); the row helpers above must not.
    if name == "SglJaxRollout":
        from sgl_jax.integrations.tunix_rollout import SglJaxRollout

        return SglJaxRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
