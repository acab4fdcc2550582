"""Compile time and forward time of every precompiled bucket.

For each (mode, padded tokens, padded rows) shape: the seconds its first call took (trace +
compile, with the persistent compilation cache disabled) and the median time of a forward +
sampling step on an all-padding batch of that shape.

    python benchmarks/bench_buckets.py [--preset qwen3-30b-a3b-routing]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_routed_experts import model_path_for  # noqa: E402
from bench_utils import machine_description, markdown_table  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.forward_batch_info import ForwardMode, make_padding_batch  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    path = model_path_for(args.preset)
    sa = ServerArgs(model_path=path, compilation_cache_dir="")
    runner = ModelRunner(sa, ModelConfig.from_hf(path))
    runner.precompile()
    rows = []
    for (mode, tokens, bs), compile_s in sorted(runner.compile_seconds.items()):
        batch = make_padding_batch(ForwardMode(mode), tokens, bs,
                                   runner.model_config.vocab_size, runner.no_req_slot)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            runner.forward(batch).next_token_ids.block_until_ready()
            times.append(time.perf_counter() - t0)
        rows.append([ForwardMode(mode).name.lower(), tokens, bs, compile_s,
                     float(np.median(times)) * 1e3])
    print(f"\n### Buckets: {args.preset or 'bundled tiny-qwen3-moe'} (default buckets)\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(["mode", "padded tokens", "padded rows", "compile s", "step ms"], rows))


if __name__ == "__main__":
    main()
