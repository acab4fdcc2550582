"""GRPO with routing replay on tunix 0.1.7: the policy's logprobs under the rollout's routing.

tunix 0.1.7's learner has no routing-replay input: ``RLCluster.generate`` drops anything
beyond ``RolloutOutput``'s five fields, and its policy loss calls the actor as
``model(tokens, positions=, cache=, attention_mask=, segment_ids=)``. ``ReplayGRPOLearner`` is
``GRPOLearner`` with the two smallest changes that carry the routing through, both on hooks
tunix's own learners use:

1. ``_generate_and_compute_advantage`` (the method every ``RLLearner`` implements): after
   tunix's, it takes the rollout's aligned routed experts (``SglJaxRollout.
   take_aligned_routed_experts``: ``[B, prompt_width + completion_width, L, k]``, the batch's
   own layout) into the example, a ``ReplayTrainExample`` (tunix's ``TrainExample`` plus
   ``routed_experts``; tunix slices mini-batches leaf by leaf, so the rows stay with their
   samples);
2. the actor trainer's loss (``PeftTrainer.with_loss_fn``, as ``GRPOLearner`` installs its own):
   tunix's registered policy loss (``policy_loss_fn`` of the config, GRPO's by default)
   unchanged, called on a view of the actor whose forward is ``forced_forward`` under that
   example's routing. So the loss, clipping, KL and aggregation are tunix's, and the policy
   logprobs and their gradients (the routers' included) are the replayed ones.

What stays tunix's: the reference model's logprobs (``beta != 0``) use the reference's own
routing (its own policy), and with ``num_iterations > 1`` the "old" logprobs are the rollout
engine's (``get_per_token_logps``: the engine's scoring, i.e. its own routing, which is the
routing replayed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

from sgl_jax.integrations.tunix_qwen3_replay import forced_forward


@flax.struct.dataclass(frozen=True)
class ReplayTrainExample(grpo_learner.TrainExample):
    """tunix's GRPO example plus the rollout's routing, int32 ``[B, P + C, L, k]``."""

    routed_experts: jax.Array | None = None


class RoutingReplayView(nnx.Module):
    """``model`` (a tunix Qwen3-MoE) called the way tunix's logprob code calls a model, with
    every forward routed by ``routed_experts`` [B, T, L, k] (-1 rows: the router's own)."""

    def __init__(self, model: nnx.Module, routed_experts: jax.Array) -> None:
        self.model = model
        self.routed_experts = nnx.Variable(jnp.asarray(routed_experts, jnp.int32))

    def __call__(self, input_tokens: jax.Array, positions: jax.Array, cache: Any,
                 attention_mask: jax.Array, output_hidden_states: bool = False,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, None]:
        if cache is not None or output_hidden_states:
            raise ValueError("routing replay runs training forwards: no cache, no hidden states")
        logits, _ = forced_forward(self.model, input_tokens, positions, attention_mask,
                                   self.routed_experts.value, segment_ids,
                                   getattr(self.model, "expert_method", "auto"))
        return logits, None


class ReplayGRPOLearner(grpo_learner.GRPOLearner):
    """tunix's ``GRPOLearner`` whose policy logprobs replay the rollout's routing (see the
    module's docstring). The rollout must hand out aligned routed experts
    (``SglJaxRollout`` with ``enable_return_routed_experts``, its default)."""

    def __init__(self, rl_cluster: rl_cluster_lib.RLCluster,
                 algo_config: grpo_learner.GRPOConfig, reward_fns: Any,
                 **kwargs: Any) -> None:
        super().__init__(rl_cluster=rl_cluster, algo_config=algo_config,
                         reward_fns=reward_fns, **kwargs)
        if not hasattr(rl_cluster.rollout, "take_aligned_routed_experts"):
            raise TypeError(f"{type(rl_cluster.rollout).__name__} hands out no routed experts: "
                            "use SglJaxRollout")
        policy_loss_fn = function_registry.get_policy_loss_fn(algo_config.policy_loss_fn)
        pad_id, eos_id = rl_cluster.rollout.pad_id(), rl_cluster.rollout.eos_id()

        def loss_fn(model: nnx.Module, train_example: ReplayTrainExample,
                    algo_config: grpo_learner.GRPOConfig) -> Any:
            view = RoutingReplayView(model, train_example.routed_experts)
            return policy_loss_fn(view, train_example, algo_config=algo_config,
                                  pad_id=pad_id, eos_id=eos_id)

        rl_cluster.actor_trainer.with_loss_fn(loss_fn, has_aux=True)

    def _generate_and_compute_advantage(
        self, training_input: Any,
        mode: rl_cluster_lib.Mode = rl_cluster_lib.Mode.TRAIN,
    ) -> ReplayTrainExample:
        example = super()._generate_and_compute_advantage(training_input, mode)
        # Everything the rollout generated for this batch, in the batch's order.
        routed = self.rl_cluster.rollout.take_aligned_routed_experts()
        if routed is None:
            raise ValueError("the rollout returned no routed experts: start its engine with "
                             "enable_return_routed_experts=True")
        batch, prompt_width = example.prompt_ids.shape
        want = (batch, prompt_width + example.completion_ids.shape[1])
        if routed.shape[:2] != want:
            raise ValueError(f"routed experts {routed.shape} do not line up with the batch "
                             f"[{want[0]}, {want[1]}, L, k]")
        fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
        return ReplayTrainExample(**fields, routed_experts=jnp.asarray(routed))
