"""Prefill throughput against prompt length: does a long prompt cost more per token?

One Engine (radix cache off, so every prompt is computed), batches of N prompts of each
length, interleaved (A B A B ...) on this noisy machine, max_new_tokens=1. Reports prefill
tokens/s (prompt tokens over the wall time of the batch) per length, the median over repeats,
and the ratio to the shortest length. With attention that reads a request's prefix once per
block of queries, a 3,072-token prompt (chunks of 1,024 over a growing prefix) should cost
little more per token than a 1,024-token prompt.

    python benchmarks/bench_prefill_context.py --lengths 1024 3072 --num-prompts 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from bench_routed_experts import model_path_for  # noqa: E402
from bench_utils import machine_description, markdown_table, median, random_prompts  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 3072])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--attention-backend", default=None, help="default: the engine's")
    p.add_argument("--page-size", type=int, default=None, help="default: the engine's")
    args = p.parse_args()

    path = model_path_for(args.preset)
    cfg = ModelConfig.from_hf(path)
    longest = max(args.lengths)
    engine = Engine(
        model_path=path, disable_radix_cache=True, log_level="warning",
        max_running_requests=args.num_prompts,
        precompile_bs_paddings=sorted({1, args.num_prompts}),
        precompile_token_paddings=sorted({64, 256, args.chunked_prefill_size}),
        chunked_prefill_size=args.chunked_prefill_size,
        context_length=min(cfg.context_len, longest + 8),
        max_total_tokens=args.num_prompts * (longest + 8),
        # Only options given are passed, so the script also runs against older trees
        # (bench_ab_commits.py).
        **{k: v for k, v in (("attention_backend", args.attention_backend),
                             ("page_size", args.page_size)) if v is not None},
    )
    params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    rates: dict[int, list[float]] = {n: [] for n in args.lengths}
    try:
        engine.generate(input_ids=random_prompts(2, 64, cfg.vocab_size, seed=99),
                        sampling_params=params)  # warm-up
        compiles0 = engine.get_server_info()["num_compiles"]
        for rep in range(args.repeats):
            for n in args.lengths:
                prompts = random_prompts(args.num_prompts, n, cfg.vocab_size, seed=rep * 7 + n)
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts, sampling_params=params)
                rates[n].append(args.num_prompts * n / (time.perf_counter() - t0))
        compiles = engine.get_server_info()["num_compiles"] - compiles0
    finally:
        engine.shutdown()

    base = median(rates[args.lengths[0]])
    rows = [[n, median(rates[n]), base / median(rates[n])] for n in args.lengths]
    print(f"\n### Prefill throughput by prompt length: {args.preset or 'bundled tiny-qwen3-moe'}, "
          f"{args.num_prompts} prompts, chunk {args.chunked_prefill_size}, radix cache off, "
          f"attention {args.attention_backend}, page size {args.page_size}\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}; "
          f"median of {args.repeats} interleaved runs; compilations while timed: {compiles}\n")
    print(markdown_table(
        ["prompt tokens", "prefill tokens/s", f"slowdown vs {args.lengths[0]}"], rows))


if __name__ == "__main__":
    main()
