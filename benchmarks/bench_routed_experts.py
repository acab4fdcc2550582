"""Cost of returning routed experts: generated tokens/s with the feature off vs on.

Two engines on the same checkpoint, one started without and one with
--enable-return-routed-experts (where every request asks for its routed experts), measured
A/B interleaved in one run at each concurrency; prints medians, the on/off ratio and the
routed-experts host/device cache sizes.

    python benchmarks/bench_routed_experts.py                      # bundled model
    python benchmarks/bench_routed_experts.py --preset qwen3-30b-a3b-routing
    python benchmarks/bench_routed_experts.py --preset qwen3-30b-a3b-routing --step --batch 16

``--step`` times the runner's step alone (no scheduler, no processes): a decode batch of
``--batch`` requests at ``--context`` positions, on two runners (capture off / on, every step
copying its rows), interleaved ABAB, medians. "jit" waits for the step's outputs; "+host"
also copies the rows to the host table (what the scheduler does per step). It uses only
``ModelRunner.run_worker_batch`` and the capturer's ``on_forward_end``, so
it runs unchanged against an older tree (``PYTHONPATH=<tree> python benchmarks/...``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import machine_description, markdown_table, median, random_prompts, timed  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402


def model_path_for(preset: str | None) -> str | None:
    if preset is None:
        return None
    path = os.path.join(tempfile.gettempdir(), f"sgl_jax_bench_{preset}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sgl_jax.tools.make_random_model import write_random_model

        write_random_model(path, preset)
    return path


def run_round(engine: Engine, prompts: list[list[int]], out_len: int, want: bool) -> int:
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True},
        return_routed_experts=want,
    )
    return sum(o["meta_info"]["completion_tokens"] for o in outs)


def step_bench(args: argparse.Namespace) -> None:
    import time

    import jax
    import numpy as np

    from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
    from sgl_jax.srt.model_executor.model_runner import ModelRunner
    from sgl_jax.srt.sampling.sampling_params import SamplingParams
    from sgl_jax.srt.server_args import ServerArgs
    from sgl_jax.testing import engine_args

    path = model_path_for(args.preset)
    cfg = ModelConfig.from_hf(path)
    bs, ctx = args.batch, args.context
    common = engine_args(model_path=path, precompile_bs_paddings=[bs], max_running_requests=bs,
                         precompile_token_paddings=[64], chunked_prefill_size=64,
                         disable_precompile=True, max_total_tokens=bs * (ctx + 64))
    runners, batches = {}, {}
    for name in ("off", "on"):
        runner = ModelRunner(ServerArgs(**common, enable_return_routed_experts=name == "on"), cfg)
        pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
        idx = [pool.alloc() for _ in range(bs)]
        for i in idx:  # a context of ``ctx`` positions (contents do not matter for timing)
            pool.write(i, 0, alloc.alloc(ctx))
        loc = alloc.alloc(bs).astype(np.int32)
        batches[name] = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE, req_pool_indices=np.array(idx, np.int32),
            prefix_lens=np.full(bs, ctx, np.int32), extend_lens=np.ones(bs, np.int32),
            input_ids=np.arange(bs, dtype=np.int32) % cfg.vocab_size, out_cache_loc=loc,
            sampling_params=[SamplingParams(temperature=0.0).normalize() for _ in range(bs)], seeds=[0] * bs, steps=[0] * bs,
            return_routed_experts=name == "on",
        )
        runners[name] = runner

    def one(name: str, host: bool) -> float:
        runner, mwb = runners[name], batches[name]
        t0 = time.perf_counter()
        _, out = runner.run_worker_batch(mwb)
        if host:
            runner.capturer.on_forward_end(out.routed_rows, mwb.out_cache_loc, bs,
                                           copy=mwb.return_routed_experts)
        jax.block_until_ready((out.next_token_ids, out.logits, out.routed_rows))
        return time.perf_counter() - t0

    for name in runners:  # compile and warm up
        for _ in range(3):
            one(name, True)
    results = []
    for host in (False, True):
        times: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(args.repeats):
            for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                times[name].append(one(name, host))
        off, on = median(times["off"]) * 1e3, median(times["on"]) * 1e3
        paired = median([a / b for a, b in zip(times["off"], times["on"], strict=True)])
        label = "jit + host copy" if host else "jit"
        results.append([label, f"{off:.2f}", f"{on:.2f}", f"{off / on:.3f}", f"{paired:.3f}"])
        print(f"{label}: off {off:.2f} ms, on {on:.2f} ms, on/off speed {off / on:.3f} "
              f"(paired {paired:.3f})", flush=True)
    print(f"\n### Step on/off: {args.preset or 'bundled'}, decode bs {bs} at {ctx} positions\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(["step", "off ms", "on ms", "on/off (speed)", "paired"], results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--fake-devices", type=int, default=0,
                   help="run on N fake CPU devices (sets XLA_FLAGS for the engine processes)")
    p.add_argument("--step", action="store_true", help="time the runner's step alone")
    p.add_argument("--batch", type=int, default=16, help="--step: decode batch size")
    p.add_argument("--context", type=int, default=512, help="--step: positions per request")
    args = p.parse_args()
    if args.step:
        step_bench(args)
        return
    if args.fake_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.fake_devices}")

    path = model_path_for(args.preset)
    cfg = ModelConfig.from_hf(path)
    bs = sorted({1, 8, 32, *args.concurrency})
    common = dict(model_path=path, precompile_bs_paddings=bs, max_running_requests=max(bs),
                  precompile_token_paddings=[64, 256, 1024, 2048], chunked_prefill_size=2048,
                  log_level="warning", tp_size=args.tp_size, ep_size=args.ep_size)
    engines = {"off": Engine(**common), "on": Engine(**common, enable_return_routed_experts=True)}
    info_on = engines["on"].get_server_info()["memory_bytes"]
    rows = []
    try:
        for c in args.concurrency:
            prompts = random_prompts(c, args.input_len, cfg.vocab_size, seed=c)
            for name, eng in engines.items():  # warm-up
                run_round(eng, prompts, args.output_len, name == "on")
            rates: dict[str, list[float]] = {"off": [], "on": []}
            for i in range(args.repeats):
                # ABBA order, so a drift of the machine's speed does not favour either side.
                for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    secs, toks = timed(lambda name=name, prompts=prompts: run_round(
                        engines[name], prompts, args.output_len, name == "on"))
                    rates[name].append(toks / secs)
            off, on = median(rates["off"]), median(rates["on"])
            paired = median([b / a for a, b in zip(rates["off"], rates["on"], strict=True)])
            rows.append([c, off, on, on / off, paired])
            print(f"concurrency {c}: off {off:.1f} tok/s, on {on:.1f} tok/s, ratio {on / off:.3f}"
                  f", median paired ratio {paired:.3f}", flush=True)
    finally:
        for eng in engines.values():
            eng.shutdown()
    name = args.preset or "bundled tiny-qwen3-moe"
    print(f"\n### Routed experts on/off: {name} (tp={args.tp_size}, ep={args.ep_size})\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(f"Input {args.input_len} / output {args.output_len} tokens per request, "
          f"{args.repeats} interleaved repeats, medians. Routed-experts caches: host "
          f"{info_on.get('routed_experts_host_cache', 0):,} B, device "
          f"{info_on.get('routed_experts_device_cache', 0):,} B "
          f"({cfg.num_hidden_layers} layers x top-{cfg.num_experts_per_tok}).\n")
    print(markdown_table(
        ["concurrency", "off tok/s", "on tok/s", "on/off (medians)", "on/off (median of pairs)"],
        rows))


if __name__ == "__main__":
    main()
