"""Two steps of tunix's GRPO with routing replay (``tunix_grpo.ReplayGRPOLearner``): the
engine as the rollout, tunix's Qwen3-MoE from the bundled checkpoint as the actor.

On this float32 model the engine's routing is the trainer's own (no rounding to tell them
apart), so replaying it would change nothing one could see. The rollout here hands the
learner the engine's routing with every expert id moved to the next expert: a routing the
trainer's router would never choose. With plain SGD the first update is exactly ``-lr *
gradient``, so the weights after step 0 say which loss the trainer differentiated: they must
be the gradient of tunix's GRPO loss with the policy's logprobs under that routing
(``replayed_per_token_logps``, tested against a float64 reference in test_tunix_replay.py), and
far from the gradient without replay. Skipped without tunix (its own CI stage: .ci/run).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tunix", reason="needs the tunix extra: pip install 'sgl_jax[tunix]'")

import optax  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

from sgl_jax.integrations.tunix import SglJaxRollout  # noqa: E402
from sgl_jax.integrations.tunix_grpo import ReplayGRPOLearner, ReplayTrainExample  # noqa: E402
from sgl_jax.integrations.tunix_qwen3 import ReplayQwen3  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH  # noqa: E402
from tests.tunix.tunix_utils import MAX_NEW, load_actor, make_mesh, rollout_config  # noqa: E402

STEPS, GENERATIONS, EXPERTS, LR = 2, 2, 16, 1e-2


class ShiftedRoutingRollout(SglJaxRollout):
    """The engine's routing, every id moved to the next expert (see the module docstring);
    records each generate's output and the actor as it was when the engine sampled."""

    def __init__(self, rollout_actor=None, **kwargs) -> None:
        super().__init__(rollout_actor=rollout_actor, **kwargs)
        self.actor = rollout_actor
        self.records: list[tuple] = []

    def generate(self, prompts, rollout_config, **kwargs):
        out = super().generate(prompts, rollout_config, **kwargs)
        self.records.append((out, nnx.clone(self.actor)))
        return out

    def take_aligned_routed_experts(self):
        routed = super().take_aligned_routed_experts()
        return np.where(routed >= 0, (routed + 1) % EXPERTS, routed)


class RecordingLearner(ReplayGRPOLearner):
    def _generate_and_compute_advantage(self, training_input, mode=rlc.Mode.TRAIN):
        example = super()._generate_and_compute_advantage(training_input, mode)
        self.examples.append(example)
        return example


def reward_letter_e(prompts, completions, **kwargs) -> list[float]:
    return [float(c.count("e")) for c in completions]


@pytest.fixture(scope="module")
def trained():
    mesh = make_mesh()
    actor = ReplayQwen3.from_model(load_actor())
    initial = nnx.clone(actor)
    cluster = rlc.RLCluster(
        actor=actor, reference=nnx.clone(actor),
        tokenizer=transformers.AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine=ShiftedRoutingRollout,
            training_config=rlc.RLTrainingConfig(
                actor_optimizer=optax.sgd(LR), eval_every_n_steps=100, max_steps=STEPS),
            rollout_config=rollout_config(seed=99),
        ))
    learner = RecordingLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=GENERATIONS, beta=0.0),
        reward_fns=reward_letter_e)
    learner.examples = []
    learner.train([{"prompts": np.array(["The cat sat on", "Once upon a time"])},
                   {"prompts": np.array(["The little dog", "She opened the door"])}])
    yield cluster, learner, initial
    cluster.rollout.shutdown()


def routers(model) -> list[np.ndarray]:
    return [np.asarray(layer.mlp.router.kernel.value) for layer in model.layers]


def test_two_replayed_steps_with_finite_losses_move_the_routers(trained):
    cluster, learner, initial = trained
    trainer = cluster.actor_trainer
    losses = trainer.metrics_logger.get_metric_history(trainer.metrics_prefix, "loss", "train")
    assert len(losses) == STEPS and np.isfinite(losses).all()
    assert len(learner.examples) == STEPS
    for example, (out, _) in zip(learner.examples, cluster.rollout.records, strict=True):
        # The example carries the (shifted) routing of exactly its samples, laid out like its
        # tokens.
        assert isinstance(example, ReplayTrainExample)
        assert example.routed_experts.shape == (
            len(out.tokens), example.prompt_ids.shape[1] + MAX_NEW, 4, 4)
        engine = out.routed_experts
        np.testing.assert_array_equal(
            np.asarray(example.routed_experts),
            np.where(engine >= 0, (engine + 1) % EXPERTS, engine))
    moved = max(float(np.abs(a - b).max())
                for a, b in zip(routers(trainer.model), routers(initial), strict=True))
    print(f"largest router weight change over {STEPS} replayed GRPO steps: {moved:.3e}")
    assert moved > 1e-4


def test_the_first_update_is_the_gradient_of_the_replayed_loss(trained):
    cluster, learner, _ = trained
    (_, before), (_, after) = cluster.rollout.records  # the actor at step 0 and at step 1
    example, algo_config = learner.examples[0], learner.algo_config
    observed = [a - b for a, b in zip(routers(after), routers(before), strict=True)]
    pad, eos = cluster.rollout.pad_id(), cluster.rollout.eos_id()

    def update(loss_fn) -> list[np.ndarray]:
        grads = nnx.grad(lambda m: loss_fn(m)[0])(before)["layers"]
        return [-LR * np.asarray(grads[i]["mlp"]["router"]["kernel"].get_value())
                for i in range(len(before.layers))]

    replayed = update(lambda m: cluster.actor_trainer.loss_fn(m, example, algo_config))
    own = update(lambda m: algo_core.grpo_loss_fn(m, example, algo_config, pad, eos))
    worst = max(float(np.abs(o - r).max()) for o, r in zip(observed, replayed, strict=True))
    off = max(float(np.abs(o - w).max()) for o, w in zip(observed, own, strict=True))
    print(f"router update vs -lr * replayed gradient: {worst:.2e}; vs -lr * gradient "
          f"without replay: {off:.2e}")
    for o, r in zip(observed, replayed, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-3, atol=1e-6)
    assert off > 100 * max(worst, 1e-6)
