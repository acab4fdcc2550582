"""Routing replay (R3) in a JAX trainer: how far a float32 trainer's logprobs are from a
bfloat16 rollout's, without and with replaying the rollout's routing (M24).

    python benchmarks/bench_r3.py [--samples 32] [--prompt-len 16] [--max-new 32]
                                  [--timing] [--stock]

Needs the tunix extra (the trainer is tunix's Qwen3-MoE). On the ``qwen3-30b-a3b-routing``
preset (48 layers, 128 experts, top-8, hidden 64; ``make_random_model``, float32 weights):

1. rollout: ``Engine(dtype="bfloat16", enable_return_routed_experts=True)`` samples
   ``--samples`` completions of ``--max-new`` tokens (T = 1, EOS ignored) from random prompts of
   ``--prompt-len`` tokens: tokens, logprobs, routed experts;
2. trainer: tunix's Qwen3-MoE in float32 from the same checkpoint (tunix's loader), the
   per-token logprobs of those completions (``replayed_per_token_logps``, T = 1) under its own
   routing and under the rollout's (``align_routed_experts`` of the engine's rows);
3. per (token, layer) with a row (every prompt token and every generated token but the
   last): does the trainer's expert set differ from the rollout's; per generated token: the
   gap due to routing ``|trainer own - trainer replayed|`` and the whole gap ``|rollout -
   trainer|`` (bfloat16 rounding included), mean and worst.

``--timing`` also measures the forced forward at this size (first call = trace + compile +
run; median run) and the same program under the trainer's own routing; ``--stock`` adds
tunix's own forward (its CPU path: one block per expert per layer, ~13 min to compile here).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table  # noqa: E402

PRESET = "qwen3-30b-a3b-routing"


def model_path() -> str:
    path = os.path.join("/tmp", f"sgl_jax_r3_{PRESET}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sgl_jax.tools.make_random_model import write_random_model

        write_random_model(path, preset=PRESET, overrides={"torch_dtype": "float32"},
                           check_routing=False)
    return path


def rollout(path: str, prompts: list[list[int]], max_new: int) -> list[dict]:
    from sgl_jax import Engine
    from sgl_jax.testing import engine_args

    n = len(prompts)
    tokens = n * len(prompts[0])
    with Engine(**engine_args(model_path=path, dtype="bfloat16",
                              enable_return_routed_experts=True,
                              precompile_bs_paddings=[n], precompile_token_paddings=[tokens],
                              chunked_prefill_size=tokens)) as engine:
        return engine.generate(
            input_ids=prompts, return_logprob=True, return_routed_experts=True,
            routed_experts_format="numpy",
            sampling_params=[{"max_new_tokens": max_new, "temperature": 1.0,
                              "ignore_eos": True, "seed": i} for i in range(n)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--stock", action="store_true")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import common

    from sgl_jax.integrations.routing_replay import align_routed_experts
    from sgl_jax.integrations.tunix_qwen3 import (
        ReplayQwen3,
        replayed_per_token_logps,
        tunix_qwen3_config,
    )
    from sgl_jax.integrations.tunix_qwen3_replay import forced_forward
    from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info

    path = model_path()
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 500, (args.samples, args.prompt_len)).tolist()
    outs = rollout(path, prompts, args.max_new)
    completions = np.array([o["output_ids"] for o in outs], np.int32)
    assert completions.shape == (args.samples, args.max_new)
    rollout_lp = np.array([[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
                           for o in outs])
    rows = [extract_routed_experts_from_meta_info(o) for o in outs]
    routed = align_routed_experts(rows, [args.max_new] * args.samples, args.prompt_len,
                                  args.max_new)
    # Nothing is padded here; the trainer's pad id must only never occur in the sequences.
    used_ids = set(np.unique(completions)) | {t for p in prompts for t in p}
    pad = next(t for t in range(512) if t not in used_ids)

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t0 = time.perf_counter()
    model = ReplayQwen3.from_model(
        qwen3_params.create_model_from_safe_tensors(path, tunix_qwen3_config(path), mesh))
    load_s = time.perf_counter() - t0
    prompt_arr = np.array(prompts, np.int32)

    def logps(routing: np.ndarray | None) -> np.ndarray:
        return np.asarray(replayed_per_token_logps(model, prompt_arr, completions, routing,
                                                   pad_id=pad, eos_id=pad))

    t0, c0 = time.perf_counter(), time.process_time()
    replayed = logps(routed)
    first_call = (time.perf_counter() - t0, time.process_time() - c0)
    own = logps(None)
    tokens, positions, mask, _ = common.process_ids(jnp.asarray(prompt_arr),
                                                    jnp.asarray(completions), pad, pad)
    width = args.prompt_len + args.max_new
    moe = (routed >= 0).any(axis=(0, 1, 3))  # [L]: layers with a router
    differs = {}  # [samples, tokens with a row, MoE layers]
    for name, routing in (("without", None), ("with", routed)):
        _, used = forced_forward(model, tokens, positions, mask,
                                 None if routing is None else jnp.asarray(routing))
        a, b = np.sort(np.asarray(used), axis=-1), np.sort(routed, axis=-1)
        differs[name] = (a != b).any(axis=-1)[:, :width - 1][:, :, moe]  # the last: no row
    # The tokens whose logits give a generated token's logprob: the prompt's last onwards.
    feeding = {k: v[:, args.prompt_len - 1:].any(axis=-1) for k, v in differs.items()}
    whole = {"without": np.abs(rollout_lp - own), "with": np.abs(rollout_lp - replayed)}
    routing_part = np.abs(own - replayed)
    table = [
        ["(token, layer) whose expert set differs from the rollout's",
         f"{differs['without'].mean():.2%}", f"{differs['with'].mean():.2%}"],
        ["generated tokens computed from a token with some layer's set different",
         f"{feeding['without'].mean():.2%}", f"{feeding['with'].mean():.2%}"],
        ["logprob gap due to routing (trainer: own vs rollout's routing), mean",
         f"{routing_part.mean():.2e}", "0"],
        ["logprob gap due to routing, worst", f"{routing_part.max():.2e}", "0"],
        ["whole gap \\|rollout - trainer\\|, mean", f"{whole['without'].mean():.2e}",
         f"{whole['with'].mean():.2e}"],
        ["whole gap, worst", f"{whole['without'].max():.2e}", f"{whole['with'].max():.2e}"],
    ]
    print(f"R3 on {PRESET} ({machine_description()}): {args.samples} samples, prompt "
          f"{args.prompt_len} + {args.max_new} generated tokens; rollout: the engine in "
          "bfloat16; trainer: tunix's Qwen3-MoE in float32 (T = 1)\n")
    print(markdown_table(["per (token, layer) or per generated token", "without replay",
                          "with replay"], table))
    print(f"\n{differs['with'].size} (token, layer) pairs, {completions.size} generated "
          f"tokens; tunix load {load_s:.1f} s")

    if args.timing:
        timing = [["forced (the rollout's routing)", f"{first_call[0]:.1f}",
                   f"{first_call[1]:.1f}", f"{_runs(lambda: logps(routed)):.0f}"],
                  ["the same program, the trainer's own routing (all -1)", "(compiled)", "",
                   f"{_runs(lambda: logps(np.full_like(routed, -1))):.0f}"]]
        if args.stock:
            graphdef, state = nnx.split(model)

            def stock() -> jax.Array:
                return common.compute_per_token_logps(graphdef, state, jnp.asarray(prompt_arr),
                                                      jnp.asarray(completions), pad, pad)

            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(stock())
            timing.append(["tunix's own forward (no replay)", f"{time.perf_counter() - t0:.1f}",
                           f"{time.process_time() - c0:.1f}", f"{_runs(stock):.0f}"])
        print(f"\nper-token logprobs of {args.samples} x {width} tokens, 48 layers x 128 "
              "experts, float32:\n")
        print(markdown_table(["forward", "first call: wall s (trace + compile + run)",
                              "its CPU s", "run ms (median of 5)"], timing))


def _runs(fn, n: int = 5) -> float:
    import jax

    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


if __name__ == "__main__":
    main()
