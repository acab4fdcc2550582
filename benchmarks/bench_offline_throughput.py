"""Offline throughput of the Engine against the model's own ceiling.

The engine serves N requests (all sent at once, at most --concurrency running). In the same run
the *ceiling* is measured: the same model's jitted forward + sampling called back to back on
the same padded batch shapes, with no scheduler, processes or tokenizer. Prints engine/ceiling
per phase:

- decode: mean wall time of an engine decode step (schedule + run + process, measured inside
  the scheduler) against the forward+sample time of a decode batch of the same size and
  context length;
- prefill: engine prefill tokens/s against the forward+sample rate on full chunks.

    python benchmarks/bench_offline_throughput.py --preset qwen3-30b-a3b-routing --concurrency 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from bench_routed_experts import model_path_for  # noqa: E402
from bench_utils import machine_description, markdown_table, median, random_prompts  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.model_executor import model_runner  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402

try:
    from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
except ImportError:  # trees before M8, for bench_ab_commits.py
    from sgl_jax.srt.model_executor.forward_batch import ForwardMode, ModelWorkerBatch
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402


def engine_run(args: argparse.Namespace, server_kwargs: dict, prompts: list[list[int]]) -> dict:
    engine = Engine(**server_kwargs)
    try:
        params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=prompts[: args.concurrency], sampling_params=params,
                        return_routed_experts=args.return_routed_experts)  # warm-up
        before = engine.get_server_info()
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params,
                               return_routed_experts=args.return_routed_experts)
        wall = time.perf_counter() - t0
        after = engine.get_server_info()
    finally:
        engine.shutdown()
    stats = {m: {k: after["step_stats"][m][k] - before["step_stats"][m][k]
                 for k in ("steps", "seconds", "tokens")} for m in ("extend", "decode")}
    return {
        "wall": wall,
        "input_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
        "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        "stats": stats,
        "compiles": after["num_compiles"] - before["num_compiles"],
    }


def ceiling_run(args: argparse.Namespace, server_kwargs: dict, repeats: int) -> dict:
    """Forward + sampling in a tight loop on the engine's padded shapes, in this process."""
    sa = ServerArgs(**server_kwargs)
    runner = ModelRunner(sa, ModelConfig.from_hf(sa.model_path, sa.context_length))
    greedy = SamplingParams(temperature=0.0).normalize()
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    bs = args.concurrency
    ctx = args.input_len + args.output_len // 2  # mean context of a decode step
    idx = [pool.alloc() for _ in range(bs)]
    for i in idx:
        pool.write(i, 0, alloc.alloc(ctx))
    decode = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE, req_pool_indices=np.array(idx, np.int32),
        prefix_lens=np.full(bs, ctx - 1, np.int32), extend_lens=np.ones(bs, np.int32),
        input_ids=np.ones(bs, np.int32), out_cache_loc=alloc.alloc(bs),
        sampling_params=[greedy] * bs, seeds=[0] * bs, steps=[0] * bs,
        return_routed_experts=args.return_routed_experts,
    )
    chunk = min(sa.chunked_prefill_size, args.input_len * bs)
    per_req = [min(args.input_len, chunk - j * args.input_len) for j in range(-(-chunk // args.input_len))]
    rows = len(per_req)
    extend = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, req_pool_indices=np.array(idx[:rows], np.int32),
        prefix_lens=np.zeros(rows, np.int32), extend_lens=np.array(per_req, np.int32),
        input_ids=np.ones(chunk, np.int32), out_cache_loc=alloc.alloc(chunk),
        sampling_params=[greedy] * rows, seeds=[0] * rows, steps=[0] * rows,
    )
    out = {}
    for name, mwb in (("decode", decode), ("extend", extend)):
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            if hasattr(runner, "run_worker_batch"):
                _, step = runner.run_worker_batch(mwb)
            else:  # trees before M8
                _, step = model_runner.forward_worker_batch(runner, mwb)
            np.asarray(step.next_token_ids)
            if step.routed_rows is not None and mwb.return_routed_experts:
                jax.device_get(step.routed_rows)  # an array, a pair, or a Routing pytree
            times.append(time.perf_counter() - t0)
        out[name] = median(times[2:])
    out["extend_tokens"] = chunk
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--return-routed-experts", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    path = model_path_for(args.preset)
    cfg = ModelConfig.from_hf(path)
    server_kwargs = dict(
        model_path=path, max_running_requests=args.concurrency,
        precompile_bs_paddings=sorted({1, args.concurrency}),
        precompile_token_paddings=[64, 256, 1024], chunked_prefill_size=1024,
        enable_return_routed_experts=args.return_routed_experts, log_level="warning",
        disable_overlap_schedule=args.disable_overlap_schedule,
    )
    prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size)
    eng = engine_run(args, server_kwargs, prompts)
    ceil = ceiling_run(args, server_kwargs, args.repeats)

    dec, ext = eng["stats"]["decode"], eng["stats"]["extend"]
    engine_step = dec["seconds"] / max(dec["steps"], 1)
    engine_prefill_rate = ext["tokens"] / max(ext["seconds"], 1e-9)
    ceiling_prefill_rate = ceil["extend_tokens"] / ceil["extend"]
    rows = [
        [f"decode step (ms, bs={args.concurrency})", engine_step * 1e3, ceil["decode"] * 1e3,
         ceil["decode"] / engine_step],
        ["prefill (tokens/s)", engine_prefill_rate, ceiling_prefill_rate,
         engine_prefill_rate / ceiling_prefill_rate],
    ]
    name = args.preset or "bundled tiny-qwen3-moe"
    print(f"\n### Offline throughput: {name}, {args.num_prompts} requests, concurrency "
          f"{args.concurrency}, input {args.input_len}, output {args.output_len}, routed experts "
          f"{'on' if args.return_routed_experts else 'off'}, overlap schedule "
          f"{'off' if args.disable_overlap_schedule else 'on'}\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(f"End to end: {eng['input_tokens'] / eng['wall']:.1f} input tok/s, "
          f"{eng['output_tokens'] / eng['wall']:.1f} output tok/s over {eng['wall']:.2f} s; "
          f"{dec['steps']} decode steps, {ext['steps']} prefill steps; compilations during the "
          f"timed run: {eng['compiles']}.\n")
    print(markdown_table(["phase", "engine", "ceiling", "engine/ceiling"], rows))


if __name__ == "__main__":
    main()
