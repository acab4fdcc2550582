"""An RL rollout loop on the bundled model: generate groups of completions with their logprobs
and routed experts, "train", load the new weights without a restart, generate again.

Run: python docs/examples/rl_rollout_loop.py (the test suite runs it). The training step is a
stand-in: it writes another random checkpoint of the same shapes, where a trainer would save
its updated weights (or hand them over with ``engine.update_weights_from_arrays``).
"""

import tempfile

import numpy as np

from sgl_jax import Engine
from sgl_jax.srt.routed_experts_codec import (
    extract_prompt_routed_experts_from_meta_info,
    extract_routed_experts_from_meta_info,
)
from sgl_jax.tools.make_random_model import write_random_model

GROUP = 4  # completions per prompt (GRPO's group)
prompts = ["The lighthouse keeper climbed", "Mixture of experts models route"]

engine = Engine(enable_return_routed_experts=True, precompile_bs_paddings=[1, 8],
                log_level="warning")
checkpoints = tempfile.mkdtemp()
for step in range(2):
    # Each prompt repeated GROUP times in one batch: it is prefilled once, and with
    # routed_experts_split its rows come once (in the group's first result).
    batch = [p for p in prompts for _ in range(GROUP)]
    results = engine.generate(
        prompt=batch,
        sampling_params=[{"max_new_tokens": 12, "temperature": 1.0, "seed": 1000 * step + i}
                         for i in range(len(batch))],
        return_logprob=True, return_routed_experts=True, routed_experts_split=True,
        routed_experts_dtype="uint8",
    )
    for g, prompt in enumerate(prompts):
        group = results[g * GROUP: (g + 1) * GROUP]
        prompt_rows = extract_prompt_routed_experts_from_meta_info(group[0])
        rewards = []
        for result in group:
            meta = result["meta_info"]
            logprobs = np.array([lp for lp, _, _ in meta["output_token_logprobs"]])
            rows = extract_routed_experts_from_meta_info(result)  # generated tokens' routing
            assert len(logprobs) == len(result["output_ids"]) == meta["completion_tokens"]
            assert rows.shape[0] == meta["completion_tokens"] - 1
            rewards.append(float(logprobs.sum()))  # a stand-in reward
        print(f"step {step} weights {group[0]['meta_info']['weight_version']}: {prompt!r} "
              f"prompt routing {prompt_rows.shape}, {GROUP} completions, "
              f"mean logprob sum {np.mean(rewards):.2f}")
    # "Train", then hand the new weights to the engine: no restart, no recompilation.
    path = f"{checkpoints}/step-{step + 1}"
    write_random_model(path, "tiny", seed=step + 1)
    update = engine.update_weights_from_disk(path, weight_version=f"step-{step + 1}")
    print(f"updated to {update['weight_version']} in {update['seconds']:.3f}s")
engine.shutdown()
