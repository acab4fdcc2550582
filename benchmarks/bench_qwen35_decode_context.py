"""Decode step time against context length for Qwen3.5-MoE's hybrid layers.

A Gated DeltaNet layer's decode costs the same at any context (one recurrent-state update per
token); only the full-attention layers (1 in 4) read the whole KV. So a decode step at 16k
context should cost little more than at 1k, unlike a model whose every layer attends.

A ModelRunner driven one batch at a time (``tests/model_driver.py``, the scheduler's host side
played by hand, no Engine: no streaming or overlap in the measurement), a random ``--preset``
checkpoint (default ``tiny-qwen3.5-moe``, context raised to fit). For each context length: a
request prefilled to that many tokens (chunks of ``--chunked-prefill-size``), then ``--steps``
greedy decode steps, each timed from dispatch to its logits on the host. Reports the median
(and min/max) step per length over ``--repeats`` requests, and the ratio to the first length.
CPU by default (whatever JAX picks).

    python benchmarks/bench_qwen35_decode_context.py --lengths 1024 16384
    python benchmarks/bench_qwen35_decode_context.py --preset tiny  # all-attention comparison
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, REPO)

from bench_utils import machine_description, markdown_table, median, random_prompts  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.forward_batch_info import ForwardMode  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402
from sgl_jax.tools.make_random_model import write_random_model  # noqa: E402
from tests.model_driver import ModelDriver  # noqa: E402


def decode_steps(driver: ModelDriver, ids: list[int], chunk: int, steps: int) -> list[float]:
    """Seconds of each decode step of one greedy request after prefilling ``ids``."""
    seq = driver.new_seq()
    for i in range(0, len(ids), chunk):
        driver.step(ForwardMode.EXTEND, [seq], [ids[i:i + chunk]], scatter=False)
    times = []
    for _ in range(steps):
        token = int(driver.last_next_ids[0])
        t0 = time.perf_counter()
        driver.step(ForwardMode.DECODE, [seq], [[token]], scatter=False)  # logits on the host
        times.append(time.perf_counter() - t0)
    driver.release(seq)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="tiny-qwen3.5-moe")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per request")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    args = p.parse_args()

    longest = max(args.lengths) + args.steps + 8
    chunk = args.chunked_prefill_size
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, args.preset)
        write_random_model(path, args.preset, {"max_position_embeddings": longest},
                           check_routing=False)
        cfg = ModelConfig.from_hf(path)
        server_args = ServerArgs(
            model_path=path, disable_radix_cache=True, max_running_requests=1,
            chunked_prefill_size=chunk, precompile_bs_paddings=[1],
            precompile_token_paddings=[chunk], context_length=longest,
            max_total_tokens=longest + chunk, enable_return_routed_experts=True)
        runner = ModelRunner(server_args, cfg)
        runner.precompile()
        driver = ModelDriver(runner)
        decode_steps(driver, random_prompts(1, 64, cfg.vocab_size, seed=99)[0], chunk, 4)
        gaps: dict[int, list[float]] = {n: [] for n in args.lengths}
        for r in range(args.repeats):
            for n in args.lengths:  # interleaved: the machine is noisy
                ids = random_prompts(1, n, cfg.vocab_size, seed=1000 * r + n)[0]
                gaps[n] += decode_steps(driver, ids, chunk, args.steps)

    linear = sum(cfg.linear_layers)
    print(f"{args.preset}: {cfg.num_hidden_layers} layers ({linear} linear attention, "
          f"{cfg.num_hidden_layers - linear} full attention); {machine_description()}")
    base = median(gaps[args.lengths[0]])
    rows = [[n, f"{median(g) * 1e3:.2f}", f"{min(g) * 1e3:.2f}", f"{max(g) * 1e3:.2f}",
             f"{median(g) / base:.2f}x", len(g)] for n, g in gaps.items()]
    print(markdown_table(["context", "median step ms", "min ms", "max ms", "vs first",
                          "steps"], rows))


if __name__ == "__main__":
    main()
