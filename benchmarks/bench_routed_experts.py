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


def model_path_for(preset: str | None, context: int | None = None) -> str | None:
    """The preset's random checkpoint (written once); ``context``: with that many positions."""
    if preset is None:
        return None
    name = f"sgl_jax_bench_{preset}" + (f"_ctx{context}" if context else "")
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sgl_jax.tools.make_random_model import write_random_model

        overrides = {"max_position_embeddings": context} if context else None
        write_random_model(path, preset, overrides, check_routing=context is None)
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


def _stage_times(n_rows: int, repeats: int, side: bool = False) -> dict[str, float]:
    """Median milliseconds of each stage of one finishing request's rows (``n_rows`` rows of
    the 48-layer preset's shape), from the host table to ``meta_info``, on the real pieces:
    the host table (``RoutedExpertsHostCache``), the wire cast (``to_wire_dtype``), the
    scheduler -> detokenizer and detokenizer -> tokenizer manager hops (``send_obj`` /
    ``recv_obj`` of a real ``BatchTokenIDOut`` over ``ipc://`` PUSH/PULL sockets, the
    detokenizer's ``with_text`` between them) and the base64 of ``RoutedExpertsOut.meta_info``.
    With ``side`` the rows take the side channel (``transport.SideSender`` -> ``SideReceiver``,
    flushed before the message, as ``OutputSender`` does): the message through the detokenizer
    carries a reference, and the tokenizer manager's receive takes the rows from the side socket
    (their transfer overlaps the first hop).
    """
    import time

    import numpy as np
    import zmq

    from sgl_jax.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut
    from sgl_jax.srt.managers.transport import recv_obj, send_obj
    from sgl_jax.srt.mem_cache.routed_experts_host_cache import RoutedExpertsHostCache

    # The OutputSender's cast (its view for a same-width wire dtype is in the codec since M21,
    # so an older tree run with PYTHONPATH=<tree> measures its own cast).
    from sgl_jax.srt.routed_experts_codec import to_wire_dtype

    layers, k, experts = 48, 8, 128
    slots_total = 4 * n_rows + 1024
    table = RoutedExpertsHostCache(slots_total, layers, k, experts)
    rng = np.random.default_rng(0)
    # Decode slots of concurrent requests interleave: a request's slots are scattered.
    slots = rng.permutation(slots_total)[:n_rows].astype(np.int64)
    table.write(slots, rng.integers(0, experts, (n_rows, layers, k), dtype=np.int32))
    table.set_valid(slots, True)

    ctx = zmq.Context()
    tmp = tempfile.mkdtemp()
    pairs = []
    for hop in ("detok", "tm"):
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{tmp}/{hop}")
        push.connect(f"ipc://{tmp}/{hop}")
        pairs.append((push, pull))
    side_out = side_in = None
    if side:
        from sgl_jax.srt.managers.transport import SideReceiver, SideSender

        side_out, side_in = SideSender(ctx, f"ipc://{tmp}/tm"), SideReceiver(ctx, f"ipc://{tmp}/tm")

    def record(ids: np.ndarray) -> tuple:
        return ("rid", [1] * 32, {"type": "length", "length": 32}, n_rows - 31, 32, 0, (), True,
                "", (ids, 0, None), None, None, None)

    times: dict[str, list[float]] = {}

    def lap(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        times.setdefault(name, []).append((t1 - t0) * 1e3)
        return t1

    for _ in range(repeats + 1):
        t = t0 = time.perf_counter()
        raw = table.gather(slots, raw=True)
        t = lap("gather (host table)", t)
        ids = to_wire_dtype(raw, "int32")
        t = lap("cast to int32", t)
        if side_out is not None:
            msg = BatchTokenIDOut.of_values([record(side_out.put(ids))])
            side_out.flush()
            send_obj(pairs[0][0], msg)
        else:
            send_obj(pairs[0][0], BatchTokenIDOut.of_values([record(ids)]))
        msg = recv_obj(pairs[0][1])
        t = lap("hop scheduler -> detokenizer", t)
        send_obj(pairs[1][0], msg.with_text([""]))
        out = recv_obj(pairs[1][1], side=side_in) if side else recv_obj(pairs[1][1])
        t = lap("hop detokenizer -> tokenizer manager" + (" (+ side rows)" if side else ""), t)
        assert isinstance(out, BatchStrOut)
        meta = out.outputs[0].routed.meta_info()
        t = lap("meta_info (base64)", t)
        lap("total", t0)
        assert len(meta["routed_experts"]) == 4 * -(-ids.nbytes // 3)
    for push, pull in pairs:
        push.close(linger=0)
        pull.close(linger=0)
    if side_out is not None and side_in is not None:
        side_out.close()
        side_in.close()
    ctx.term()
    return {name: median(ts[1:]) for name, ts in times.items()}


def stages_bench(args: argparse.Namespace) -> None:
    results = {n: _stage_times(n, args.repeats, side=args.side) for n in args.rows}
    names = list(next(iter(results.values())))
    route = "side channel" if args.side else "through the detokenizer"
    print(f"\n### Finish path per stage, one request, 48 layers x top-8, int32 wire, {route}\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    header = ["stage", *(f"{n:,} rows ({n * 48 * 8 * 4 / 2**20:.2f} MiB) ms" for n in results)]
    print(markdown_table(header, [[name, *(results[n][name] for n in results)]
                                  for name in names]))


def finish_bench(args: argparse.Namespace) -> None:
    """``--finish N``: the time one request over a cached N-token prompt takes with and without
    its rows (int32, N - 1 rows), through ``Engine.generate`` (base64 in ``meta_info``), the
    two interleaved on one engine; medians and the added time."""
    import time

    n = args.finish
    path = model_path_for(args.preset)
    cfg = ModelConfig.from_hf(path)
    if n + 64 > cfg.context_len:  # the same weights' shape with room for the prompt
        path = model_path_for(args.preset, context=n + 64)
        cfg = ModelConfig.from_hf(path)
    engine = Engine(model_path=path, precompile_bs_paddings=[1], max_running_requests=1,
                    precompile_token_paddings=[64, 1024, 4096], chunked_prefill_size=4096,
                    log_level="warning", enable_return_routed_experts=True)
    prompt = random_prompts(1, n, cfg.vocab_size, seed=n)[0]
    params = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}

    def one(want: bool) -> float:
        t0 = time.perf_counter()
        out = engine.generate(input_ids=prompt, sampling_params=params, return_routed_experts=want)
        secs = time.perf_counter() - t0
        assert (out["meta_info"].get("routed_experts") is not None) == want
        return secs

    try:
        for want in (True, False, True, False):  # cache the prompt with its rows; warm up
            one(want)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats):
            for want in (False, True) if i % 2 == 0 else (True, False):
                times[want].append(one(want))
    finally:
        engine.shutdown()
    off, on = median(times[False]) * 1e3, median(times[True]) * 1e3
    mib = (n - 1) * cfg.num_hidden_layers * cfg.num_experts_per_tok * 4 / 2**20
    print(f"\n`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(["prompt tokens", "rows MiB (int32)", "without rows ms", "with rows ms",
                          "added ms"], [[n, mib, off, on, on - off]]))


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
    p.add_argument("--stages", action="store_true",
                   help="time each stage of one request's finish path (no engine)")
    p.add_argument("--rows", type=int, nargs="+", default=[1024, 8192],
                   help="--stages: rows of the request")
    p.add_argument("--side", action="store_true",
                   help="--stages: the rows take the side channel (transport.SideSender)")
    p.add_argument("--finish", type=int, default=0,
                   help="time one request over a cached prompt of N tokens with / without rows")
    args = p.parse_args()
    if args.finish:
        finish_bench(args)
        return
    if args.stages:
        stages_bench(args)
        return
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
    rows: list[list] = []
    split: list[list] = []
    try:
        for c in args.concurrency:
            prompts = random_prompts(c, args.input_len, cfg.vocab_size, seed=c)
            for name, eng in engines.items():  # warm-up
                run_round(eng, prompts, args.output_len, name == "on")
            rates: dict[str, list[float]] = {"off": [], "on": []}
            walls = {"off": 0.0, "on": 0.0}
            before = {name: _step_totals(eng) for name, eng in engines.items()}
            for i in range(args.repeats):
                # ABBA order, so a drift of the machine's speed does not favour either side.
                for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    secs, toks = timed(lambda name=name, prompts=prompts: run_round(
                        engines[name], prompts, args.output_len, name == "on"))
                    rates[name].append(toks / secs)
                    walls[name] += secs
            off, on = median(rates["off"]), median(rates["on"])
            paired = median([b / a for a, b in zip(rates["off"], rates["on"], strict=True)])
            rows.append([c, off, on, on / off, paired])
            print(f"concurrency {c}: off {off:.1f} tok/s, on {on:.1f} tok/s, ratio {on / off:.3f}"
                  f", median paired ratio {paired:.3f}", flush=True)
            for name, eng in engines.items():
                split.append([c, name, *_step_split(before[name], _step_totals(eng),
                                                    walls[name], args.repeats)])
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
    print("\nWhere a round's time goes (scheduler step_stats over the measured rounds, per "
          "round): whole scheduler steps by mode, and the rest of the round's wall time "
          "(the finish path, the hops, the callers' side, idle).\n")
    print(markdown_table(
        ["concurrency", "engine", "decode steps", "decode ms/step", "extend ms/round",
         "steps ms/round", "rest ms/round", "compiles"], split))


def _step_totals(engine: Engine) -> dict[str, float]:
    info = engine.get_server_info()
    stats = info["step_stats"]
    return {"decode_s": stats["decode"]["seconds"], "decode_n": stats["decode"]["steps"],
            "extend_s": stats["extend"]["seconds"], "compiles": info["num_compiles"]}


def _step_split(before: dict[str, float], after: dict[str, float], wall: float,
                rounds: int) -> list:
    """Per round: decode steps, ms per decode step, extend ms, all steps ms, the rest ms,
    compiles during the rounds."""
    d = {k: after[k] - before[k] for k in after}
    steps_s = d["decode_s"] + d["extend_s"]
    return [d["decode_n"] / rounds, 1e3 * d["decode_s"] / max(d["decode_n"], 1),
            1e3 * d["extend_s"] / rounds, 1e3 * steps_s / rounds,
            1e3 * (wall - steps_s) / rounds, int(d["compiles"])]


if __name__ == "__main__":
    main()
