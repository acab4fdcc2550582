"""The colocated RL loop on one slice, with the bundled model: the engine in the trainer's
process, and per step generate -> score -> train -> sync -> release/resume.

Run: python docs/examples/colocated_loop.py (the test suite runs it). The "trainer" holds the
weights as JAX arrays by Hugging Face name and its update is a stand-in (a small step along a
random direction, on the device): a real one would come from a JAX optimizer.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.flax import load_file

from sgl_jax import Engine
from sgl_jax.srt.configs.model_config import resolve_model_path
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info

GROUP = 4  # completions per prompt (GRPO's group)
PROMPT = "Mixture of experts models route"

# The trainer's weights, on its devices (here: the bundled checkpoint's tensors).
params = load_file(os.path.join(resolve_model_path(None), "model.safetensors"))
engine = Engine(enable_single_process=True, enable_return_routed_experts=True,
                precompile_bs_paddings=[1, 4], log_level="warning")
prompt_ids = engine.tokenizer_manager.tokenizer.encode(PROMPT)
key = jax.random.key(0)
previous = None
for step in range(2):
    # 1. Rollouts: tokens, their logprobs and the routed experts (for routing replay).
    results = engine.generate(
        input_ids=[prompt_ids] * GROUP,
        sampling_params=[{"max_new_tokens": 8, "temperature": 1.0, "seed": 100 * step + i}
                         for i in range(GROUP)],
        return_logprob=True, return_routed_experts=True)
    completions = [r["output_ids"] for r in results]
    sampled = [np.array([lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]])
               for r in results]
    routing = [extract_routed_experts_from_meta_info(r) for r in results]
    # 2. Score the completions (here with the rollout weights, as a reference policy would be
    #    scored): the prompt is computed once for the group.
    scored = engine.score(prompt_ids, completions, return_routed_experts=True)
    gap = max(float(np.max(np.abs(np.array(s["logprobs"]) - lp)))
              for s, lp in zip(scored, sampled, strict=True))
    print(f"step {step}: {GROUP} completions, routed experts {routing[0].shape}, "
          f"score vs sampled logprobs max |diff| {gap:.2e}, "
          f"prompt reused by {sum(s['cached_tokens'] > 0 for s in scored)} of {GROUP}")
    assert previous is None or completions != previous  # the synced weights changed them
    previous = completions

    # 3. Train: the KV cache is not needed meanwhile, so its memory goes to the trainer.
    released = engine.release_memory_occupation(["kv_cache"])
    print(f"released the KV cache: {released['device_bytes_before']:,} -> "
          f"{released['device_bytes_after']:,} device bytes")
    key, sub = jax.random.split(key)
    names = sorted(n for n in params if ".mlp.experts." in n or "self_attn" in n)
    noise = jax.random.split(sub, len(names))
    params.update({n: params[n] + 0.05 * jnp.std(params[n]) * jax.random.normal(
        k, params[n].shape, params[n].dtype) for n, k in zip(names, noise, strict=True)})

    # 4. Sync: the arrays reach the engine by reference, converted on the device.
    update = engine.update_weights_from_arrays(params, weight_version=f"step-{step + 1}")
    print(f"synced {update['num_parameters']} parameters in {update['seconds']:.3f}s, "
          f"{update['host_bytes']} host byte(s)")

    # 5. Resume the KV cache (no recompilation) and go on.
    engine.resume_memory_occupation(["kv_cache"])
engine.shutdown()
print("done")
