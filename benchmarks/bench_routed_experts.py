"""Cost of returning routed experts: generated tokens/s with the feature off vs on.

Two engines on the same checkpoint, one started without and one with
--enable-return-routed-experts (where every request asks for its routed experts), measured
A/B interleaved in one run at each concurrency; prints medians, the on/off ratio and the
routed-experts host/device cache sizes.

    python benchmarks/bench_routed_experts.py                      # bundled model
    python benchmarks/bench_routed_experts.py --preset qwen3-30b-a3b-routing
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
    args = p.parse_args()
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
