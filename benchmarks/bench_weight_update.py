"""Time of a weight update without a restart (M10): ``Engine.update_weights_from_disk``.

For each preset, two random checkpoints of the same shapes are written (``make_random_model``);
an Engine starts on the first, then updates alternate between them. Reported: the update call
as the caller sees it (median, min, max over ``--rounds``), the engine's own read-and-place time,
the checkpoint size, and the compile count before and after (it must not move).

    python benchmarks/bench_weight_update.py [--presets tiny qwen3-30b-a3b-routing] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from sgl_jax import Engine
from sgl_jax.testing import engine_args
from sgl_jax.tools.make_random_model import write_random_model


def checkpoint(preset: str, seed: int) -> str:
    path = os.path.join(tempfile.gettempdir(), f"sgl_jax_bench_weights_{preset}_{seed}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        write_random_model(path, preset, seed=seed, check_routing=False)
    return path


def run(preset: str, rounds: int) -> dict[str, float]:
    paths = [checkpoint(preset, seed) for seed in (0, 1)]
    size = os.path.getsize(os.path.join(paths[0], "model.safetensors"))
    engine = Engine(**engine_args(model_path=paths[0], enable_return_routed_experts=True))
    try:
        compiles = engine.get_server_info()["num_compiles"]
        calls, inner = [], []
        for i in range(rounds):
            t0 = time.perf_counter()
            out = engine.update_weights_from_disk(paths[(i + 1) % 2])
            calls.append(time.perf_counter() - t0)
            inner.append(out["seconds"])
            engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        after = engine.get_server_info()["num_compiles"]
    finally:
        engine.shutdown()
    return {"size_mb": size / 2**20, "median_ms": 1e3 * statistics.median(calls),
            "min_ms": 1e3 * min(calls), "max_ms": 1e3 * max(calls),
            "inner_ms": 1e3 * statistics.median(inner), "compiles": f"{compiles} -> {after}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "qwen3-30b-a3b-routing"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("| preset | checkpoint MiB | update median ms | min | max | read+place ms | compiles |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets:
        r = run(preset, args.rounds)
        print(f"| {preset} | {r['size_mb']:.1f} | {r['median_ms']:.0f} | {r['min_ms']:.0f} | "
              f"{r['max_ms']:.0f} | {r['inner_ms']:.0f} | {r['compiles']} |")


if __name__ == "__main__":
    main()
