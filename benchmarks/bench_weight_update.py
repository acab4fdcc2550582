"""Time of a weight update without a restart (M10, M18).

For each preset, two random checkpoints of the same shapes are written (``make_random_model``);
an Engine starts on the first, then updates alternate between them, a generate after each.
Modes (``--modes``):

- ``disk``: ``update_weights_from_disk`` (the child-process engine reads the files);
- ``arrays``: ``update_weights_from_arrays`` with JAX arrays, child-process engine (they are
  fetched to host memory, pickled through the scheduler's socket and placed again);
- ``on-device``: the same call on a single-process engine (``enable_single_process``): the
  arrays reach the scheduler thread by reference and are converted on the devices.

Reported: the call as the caller sees it (median, min, max over ``--rounds``; the first
on-device round compiles the conversion programs and is left out of the median, as it is
once per process and shape), the engine's own time, the bytes through host memory (the reply's
``host_bytes``: -1 from disk, not counted), the peak live device bytes above the start
(on-device only, in one more round with ``measure_memory``, not timed), the checkpoint size, and the compile count before and after (it must not
move).

    python benchmarks/bench_weight_update.py [--presets tiny qwen3-30b-a3b-routing] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
from safetensors.numpy import load_file

from sgl_jax import Engine
from sgl_jax.srt.model_executor.memory_occupation import live_device_bytes
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model

MODES = ("disk", "arrays", "on-device")


def checkpoint(preset: str, seed: int) -> str:
    path = os.path.join(tempfile.gettempdir(), f"sgl_jax_bench_weights_{preset}_{seed}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_random_model(path, preset, seed=seed, check_routing=False)
    return path


def run(preset: str, mode: str, rounds: int) -> dict[str, Any]:
    paths = [checkpoint(preset, seed) for seed in (0, 1)]
    size = os.path.getsize(os.path.join(paths[0], "model.safetensors"))
    sources: list[Any] = paths
    if mode != "disk":  # the trainer's arrays: on the devices before the clock starts
        sources = [{k: jnp.asarray(v) for k, v in load_file(f"{p}/model.safetensors").items()}
                   for p in paths]
        jax.block_until_ready(sources)
    engine = Engine(**engine_args(model_path=paths[0], enable_return_routed_experts=True,
                                  enable_single_process=mode == "on-device"))
    try:
        compiles = engine.get_server_info()["num_compiles"]
        calls, inner, host, peak = [], [], [], []
        warmup = 1 if mode == "on-device" else 0
        for i in range(rounds + warmup + (mode == "on-device")):
            # on-device: one more round, untimed, measuring the peak (a scan of every array)
            measure = mode == "on-device" and i == rounds + warmup
            new = sources[(i + 1) % 2]
            before = live_device_bytes() if measure else 0
            t0 = time.perf_counter()
            if mode == "disk":
                out = engine.update_weights_from_disk(new)
            else:
                out = engine.update_weights_from_arrays(new, measure_memory=measure)
            if measure:
                peak.append(out["peak_device_bytes"] - before)
            elif i >= warmup:
                calls.append(time.perf_counter() - t0)
                inner.append(out["seconds"])
                host.append(out["host_bytes"])
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        after = engine.get_server_info()["num_compiles"]
    finally:
        engine.shutdown()
    return {"size_mb": size / 2**20, "median_ms": 1e3 * statistics.median(calls),
            "min_ms": 1e3 * min(calls), "max_ms": 1e3 * max(calls),
            "inner_ms": 1e3 * statistics.median(inner), "host_bytes": max(host),
            "peak_mb": max(peak, default=0) / 2**20, "compiles": f"{compiles} -> {after}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "qwen3-30b-a3b-routing"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| preset | mode | checkpoint MiB | update median ms | min | max | engine ms | "
          "host bytes | peak above start MiB | compiles |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets:
        for mode in args.modes:
            r = run(preset, mode, args.rounds)
            print(f"| {preset} | {mode} | {r['size_mb']:.1f} | {r['median_ms']:.0f} | "
                  f"{r['min_ms']:.0f} | {r['max_ms']:.0f} | {r['inner_ms']:.0f} | "
                  f"{r['host_bytes']} | {r['peak_mb']:.2f} | {r['compiles']} |", flush=True)


if __name__ == "__main__":
    main()
