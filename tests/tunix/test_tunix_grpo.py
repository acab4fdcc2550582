"""Two steps of tunix's GRPO with our engine as the rollout (``ClusterConfig(rollout_engine=
SglJaxRollout)``) and tunix's own Qwen3-MoE as the actor, both from the bundled checkpoint.

What must hold, against tunix's model as the independent reference:
- before the first step the engine serves the actor's weights, and after every step tunix's
  weight sync reaches the engine: the engine's logprobs of its own samples at step k equal the
  trainer's recomputation (``compute_per_token_logps``) with the actor's weights of that
  moment, which differ from the initial weights' by far more than the tolerance;
- after training, the engine scores a probe as the trained actor does, and generates exactly
  what a fresh engine started on the trained weights (written as a checkpoint) generates.
The largest engine-trainer difference is printed: the train-inference mismatch. Run twice: the
engine in child processes (the default) and in tunix's process (``enable_single_process``: the
weight syncs go on device, under tunix's transfer guard). Skipped without tunix (its own CI stage installs it: .ci/run).
"""

from __future__ import annotations

import functools
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("tunix", reason="needs the tunix extra: pip install 'sgl_jax[tunix]'")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tunix.rl import rl_cluster as rlc  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.integrations.tunix import SglJaxRollout  # noqa: E402
from sgl_jax.integrations.tunix_qwen3 import hf_arrays_from_tunix_qwen3  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH  # noqa: E402
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info  # noqa: E402
from sgl_jax.testing import engine_args  # noqa: E402
from tests.tunix.tunix_utils import (  # noqa: E402
    MAX_NEW,
    TOL,
    load_actor,
    make_mesh,
    right_padded,
    rollout_config,
    tunix_logps,
)

STEPS, PROMPTS_PER_STEP, GENERATIONS = 2, 2, 2


class RecordingRollout(SglJaxRollout):
    """Keeps, for every rollout, its output, its routed experts and a copy of the actor as it
    was when the engine sampled (the trainer's weights of that moment)."""

    def __init__(self, rollout_actor=None, **kwargs) -> None:
        super().__init__(rollout_actor=rollout_actor, **kwargs)
        self.actor = rollout_actor
        self.records: list[tuple] = []

    def generate(self, prompts, rollout_config, **kwargs):
        out = super().generate(prompts, rollout_config, **kwargs)
        self.records.append((out, self.take_routed_experts(), nnx.clone(self.actor)))
        return out


def reward_letter_e(prompts, completions, **kwargs) -> list[float]:
    return [float(c.count("e")) for c in completions]


@pytest.fixture(scope="module", params=[False, True], ids=["child-process", "single-process"])
def trained(request):
    mesh = make_mesh()
    actor = load_actor()
    initial = nnx.clone(actor)
    cluster = rlc.RLCluster(
        actor=actor, reference=nnx.clone(actor),
        tokenizer=transformers.AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine=functools.partial(RecordingRollout,
                                             enable_single_process=request.param),
            training_config=rlc.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-3), eval_every_n_steps=100, max_steps=STEPS),
            rollout_config=rollout_config(seed=1234),
        ))
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=GENERATIONS),
        reward_fns=reward_letter_e)
    data = [{"prompts": np.array(["The cat sat on", "Once upon a time"])},
            {"prompts": np.array(["The little dog", "She opened the door"])}]
    learner.train(data)
    yield cluster, initial
    cluster.rollout.shutdown()


def test_the_engine_samples_with_the_trainers_weights_at_every_step(trained):
    cluster, initial = trained
    rollout = cluster.rollout
    assert isinstance(rollout, RecordingRollout)
    assert cluster.actor_trainer.model is rollout.actor  # the actor tunix trains
    assert len(rollout.records) == STEPS
    pad, eos = rollout.pad_id(), rollout.eos_id()
    largest = 0.0
    for step, (out, experts, actor_then) in enumerate(rollout.records):
        assert len(out.tokens) == PROMPTS_PER_STEP * GENERATIONS
        prompts = out.left_padded_prompt_tokens
        completions = right_padded(out.tokens, MAX_NEW, pad)
        mask = completions != pad
        engine = right_padded(out.logprobs, MAX_NEW, 0.0)
        trainer = tunix_logps(actor_then, prompts, completions, pad, eos)
        diff = np.abs(engine - trainer)[mask].max()
        largest = max(largest, diff)
        moved = np.abs(tunix_logps(initial, prompts, completions, pad, eos) - trainer)[mask].max()
        print(f"step {step}: largest |engine - trainer| logprob {diff:.2e}; the actor's "
              f"logprobs moved {moved:.2e} from the initial weights")
        assert diff < TOL, step
        # Step 0 samples with the initial weights; by step 1 training has moved them far
        # beyond the tolerance, so the agreement above shows the synced weights were used.
        assert (moved == 0) if step == 0 else (moved > 100 * TOL)
        # Routed experts for routing replay: one array per sample, in the batch's order.
        assert [e.shape[0] for e in experts] == [
            int((p != pad).sum()) + len(t) - 1 for p, t in zip(prompts, out.tokens, strict=True)]
    print(f"train-inference mismatch over {STEPS} GRPO steps: largest |engine - trainer| "
          f"per-token logprob {largest:.2e}")


def test_after_training_the_engine_serves_the_trained_actor(trained):
    cluster, initial = trained
    rollout = cluster.rollout
    pad, eos = rollout.pad_id(), rollout.eos_id()
    prompts = np.array([[pad, 313, 273, 271], [46, 77, 354, 220]])
    completions = np.array([[260, 412, 271, 299], [453, 11, pad, pad]])
    mask = completions != pad
    got = np.asarray(rollout.get_per_token_logps(jnp.asarray(prompts), jnp.asarray(completions)))
    want = tunix_logps(cluster.actor_trainer.model, prompts, completions, pad, eos)
    before = tunix_logps(initial, prompts, completions, pad, eos)
    assert np.abs(got - want)[mask].max() < TOL
    assert np.abs(got - before)[mask].max() > 100 * TOL
    assert rollout.engine.get_server_info()["weight_version"] == f"tunix-sync-{STEPS + 1}"


def test_after_training_the_engine_equals_a_fresh_engine_on_the_trained_weights(trained,
                                                                                 tmp_path):
    cluster, _ = trained
    arrays = hf_arrays_from_tunix_qwen3(nnx.state(cluster.actor_trainer.model, nnx.Param))
    for name in os.listdir(BUNDLED_MODEL_PATH):
        if name != "model.safetensors":
            shutil.copy(os.path.join(BUNDLED_MODEL_PATH, name), tmp_path)
    save_file({k: np.asarray(v) for k, v in arrays.items()}, str(tmp_path / "model.safetensors"))
    # One request at a time on an empty prefix cache: the same programs on the same inputs,
    # so the same bits (a batch or a cache hit would round differently).
    def run(engine: Engine) -> list[dict]:
        engine.flush_cache()
        return [engine.generate(input_ids=ids, return_logprob=True, return_routed_experts=True,
                                sampling_params={"max_new_tokens": 8, "temperature": 0.0})
                for ids in ([46, 77, 354, 220], [313, 273, 271])]

    fresh = Engine(**engine_args(model_path=str(tmp_path), enable_return_routed_experts=True))
    try:
        want = run(fresh)
    finally:
        fresh.shutdown()
    got = run(cluster.rollout.engine)
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["output_token_logprobs"] == w["meta_info"]["output_token_logprobs"]
        np.testing.assert_array_equal(extract_routed_experts_from_meta_info(g),
                                      extract_routed_experts_from_meta_info(w))
