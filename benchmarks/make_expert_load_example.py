"""The example picture of docs/expert_load.md: expert load of a skewed workload, from the engine.

Writes a routing-shaped random checkpoint (Qwen3-30B-A3B's 48 layers x 128 experts, top-8, at a
tiny width), runs an Engine with routed experts over a skewed workload (prompts drawn from a
vocabulary of a few tokens, so the routers see few distinct inputs), counts the returned routed
experts per layer and expert into a ``stat``-mode dump, and draws it with
``python -m sgl_jax.tools.expert_load DUMP --ep-size 4 --balanced both`` (the contiguous
placement, ``balanced_mapping`` of the per-expert totals, and of each layer's counts):

    python benchmarks/make_expert_load_example.py                      # docs/images/...
    python benchmarks/make_expert_load_example.py --workload random    # the contrast

The dump's layout is the recorder's ``stat`` mode (``counts [layers, E]``, ``num_tokens`` and
the metadata arrays), so the picture is drawn exactly as a recorder dump would be.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts_for(workload: str, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if workload == "skewed":  # a handful of prompts from a 6-token vocabulary, repetitive
        vocab = rng.choice(np.arange(10, 500), size=6, replace=False)
        motifs = [rng.choice(vocab, size=rng.integers(2, 5)) for _ in range(3)]
        out = []
        for i in range(n):
            motif = motifs[i % len(motifs)]
            ids = np.resize(motif, length)
            flips = rng.random(length) < 0.1  # a little noise, from the same small vocabulary
            ids[flips] = rng.choice(vocab, size=int(flips.sum()))
            out.append(ids.tolist())
        return out
    return rng.integers(0, 500, size=(n, length)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b-routing")
    ap.add_argument("--workload", choices=["skewed", "random"], default="skewed")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--balanced", choices=["total", "per-layer", "both"], default="both",
                    help="the AFTER placement(s) drawn (expert_load --balanced)")
    ap.add_argument("--dump", default=None, help="the stat .npz (default: a temp file)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "images",
                                                  "expert_load_example.png"))
    args = ap.parse_args()

    from sgl_jax import Engine
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.layers.moe.balancing import expert_load
    from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
    from sgl_jax.tools.make_random_model import write_random_model

    model = os.path.join(tempfile.gettempdir(), f"sgl_jax_example_{args.preset}")
    if not os.path.exists(os.path.join(model, "model.safetensors")):
        write_random_model(model, args.preset)
    cfg = ModelConfig.from_hf(model)
    num_layers, num_experts, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok

    prompts = prompts_for(args.workload, args.num_prompts, args.prompt_len, args.seed)
    engine = Engine(
        model_path=model, enable_return_routed_experts=True, log_level="warning",
        precompile_bs_paddings=[1, 4, 16], precompile_token_paddings=[256, 1024],
        chunked_prefill_size=1024,
    )
    try:
        outs = engine.generate(
            input_ids=prompts, return_routed_experts=True,
            sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                             "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    rows = np.concatenate([
        extract_routed_experts_from_meta_info(o).reshape(-1, num_layers, k) for o in outs])
    counts = expert_load(rows, num_experts)  # [layers, E]; -1 rows (dense layers) count nothing
    moe_layers = list(cfg.moe_layer_ids)
    dump = args.dump or os.path.join(tempfile.gettempdir(), f"expert_load_{args.workload}.npz")
    np.savez(
        dump, mode="stat", counts=counts, num_tokens=np.int64(rows.shape[0]),
        moe_layers=np.asarray(moe_layers, np.int64), num_experts=np.int64(num_experts),
        num_experts_per_tok=np.int64(k), architecture=cfg.architecture,
    )
    print(f"{args.workload}: {len(prompts)} prompts, {rows.shape[0]} token rows, "
          f"{len(moe_layers)} MoE layers x {num_experts} experts (top-{k}); dump {dump}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "sgl_jax.tools.expert_load", dump, "--out", args.out,
         "--ep-size", str(args.ep_size), "--balanced", args.balanced,
         "--title", f"expert utilisation, {args.workload} workload: {args.preset} random "
         f"checkpoint, {len(prompts)} prompts, {rows.shape[0]} tokens"],
        check=True,
    )


if __name__ == "__main__":
    main()
