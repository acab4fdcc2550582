"""Batch invariance: is a request's output bitwise the same alone and inside varied batches?

For each model and each mode (``--enable-deterministic-inference`` off / on) the script starts
engines (overlap on, and overlap off) and runs a few *target* requests (greedy, logprobs and
routed experts returned) alone, then inside varied batches: other random requests of various
prompt lengths and output lengths submitted together with the target, before or after it, so
that the decode batch size (the padding bucket) changes while the target runs and a long
target prompt is chunked at different positions. The prefix cache is flushed before every
run. Every (target, run) is compared bitwise with the target alone on the overlap-on engine:
output ids, ``output_token_logprobs`` and the routed experts.

    python benchmarks/bench_determinism.py                      # identity tables, both modes
    python benchmarks/bench_determinism.py --modes off --models tiny
    python benchmarks/bench_determinism.py --throughput          # cost of the mode, A/B

``--throughput`` starts one engine per mode side by side and times the same workloads on
each in interleaved rounds (off, on, off, on, ...), reporting median output tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from bench_utils import machine_description, markdown_table, median  # noqa: E402

from sgl_jax import Engine  # noqa: E402
from sgl_jax.srt.configs.model_config import BUNDLED_MODEL_PATH  # noqa: E402
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info  # noqa: E402
from sgl_jax.testing import engine_args  # noqa: E402

ROUTING_PRESET = "qwen3-30b-a3b-routing"
TARGET_LENS = (7, 60, 200, 420)  # 420 > chunked_prefill_size (256): chunked
MAX_NEW = 48
VOCAB = 500


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, VOCAB, n).tolist()


def targets(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [prompt(rng, n) for n in TARGET_LENS]


def batch_variants(target: list[int], seed: int) -> list[tuple[list[list[int]], list[int], int]]:
    """(prompts, max_new_tokens, index of the target) per batched run of ``target``."""
    rng = np.random.default_rng(seed)
    out = []
    # mates: (prompt lengths, output lengths, position of the target)
    layouts = [
        ([30], [MAX_NEW * 2], 1),  # one mate first: decode batch 2 (bucket 4), shifted chunk
        ([int(rng.integers(5, 300)) for _ in range(3)], [8, 24, 64], 2),  # mates around it
        ([100], [16], 1),  # a 100-token mate first: the target's prefill starts at token 100
        ([int(rng.integers(5, 150)) for _ in range(2)], [4, MAX_NEW + 8], 0),  # mates after
        ([int(rng.integers(200, 500)), 9, 17], [32, 40, 2], 3),  # a long mate: many chunks
    ]
    for lens, news, where in layouts:
        prompts = [prompt(rng, n) for n in lens]
        max_new = list(news)
        prompts.insert(where, target)
        max_new.insert(where, MAX_NEW)
        out.append((prompts, max_new, where))
    return out


def run(engine: Engine, prompts: list[list[int]], max_new: list[int]) -> list[dict[str, Any]]:
    engine.flush_cache()
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in max_new]
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                           return_routed_experts=True)


def summary(result: dict[str, Any]) -> tuple[list[int], np.ndarray, np.ndarray]:
    lps = np.array([e[0] for e in result["meta_info"]["output_token_logprobs"]], np.float32)
    rows = extract_routed_experts_from_meta_info(result)
    return list(result["output_ids"]), lps, np.asarray(rows)


def compare(a: tuple, b: tuple) -> dict[str, Any]:
    ids_a, lp_a, re_a = a
    ids_b, lp_b, re_b = b
    same_ids = ids_a == ids_b
    # Logprob difference over the common prefix of identical tokens.
    n = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)) if x != y),
             len(ids_a))
    diff = float(np.max(np.abs(lp_a[:n] - lp_b[:n]))) if n else 0.0
    same_lp = same_ids and lp_a.tobytes() == lp_b.tobytes()
    same_re = re_a.shape == re_b.shape and re_a.tobytes() == re_b.tobytes()
    return {"ids": same_ids, "lp": same_lp, "re": same_re, "diff": diff,
            "all": same_ids and same_lp and same_re}


def model_path(name: str) -> str:
    if name == "tiny":
        return BUNDLED_MODEL_PATH
    path = os.path.join("/tmp", f"sgl_jax_det_{ROUTING_PRESET}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sgl_jax.tools.make_random_model import write_random_model
        write_random_model(path, preset=ROUTING_PRESET, check_routing=False)
    return path


def engine_kwargs(path: str, deterministic: bool, overlap: bool) -> dict[str, Any]:
    kw = engine_args(model_path=path, enable_return_routed_experts=True,
                     disable_overlap_schedule=not overlap)
    if deterministic:
        kw["enable_deterministic_inference"] = True
    return kw


def identity(name: str, deterministic: bool) -> list[Any]:
    path = model_path(name)
    tgts = targets()
    base: list[tuple] = []
    stats: list[dict[str, Any]] = []
    for overlap in (True, False):
        with Engine(**engine_kwargs(path, deterministic, overlap)) as engine:
            for i, t in enumerate(tgts):
                alone = summary(run(engine, [t], [MAX_NEW])[0])
                if overlap:
                    base.append(alone)
                else:
                    stats.append(compare(base[i], alone))
                for prompts, max_new, where in batch_variants(t, seed=100 + i):
                    stats.append(compare(base[i], summary(run(engine, prompts, max_new)[where])))
    n = len(stats)

    def rate(key: str) -> str:
        k = sum(s[key] for s in stats)
        return f"{k}/{n} ({100 * k / n:.0f}%)"

    return [name, "on" if deterministic else "off", rate("all"), rate("ids"), rate("lp"),
            rate("re"), f"{max(s['diff'] for s in stats):.2e}"]


def workload(seed: int, n: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(8, 300, n)
    return [prompt(rng, int(x)) for x in lens], [64] * n


def throughput(name: str, rounds: int, sizes: list[int]) -> list[list[Any]]:
    path = model_path(name)
    engines = {mode: Engine(**engine_kwargs(path, mode == "on", True)) for mode in ("off", "on")}
    rows = []
    try:
        for size in sizes:
            prompts, max_new = workload(size, size)
            for engine in engines.values():  # warm-up
                run(engine, prompts, max_new)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(rounds):
                for mode, engine in engines.items():
                    t0 = time.perf_counter()
                    out = run(engine, prompts, max_new)
                    took = time.perf_counter() - t0
                    rates[mode].append(sum(len(o["output_ids"]) for o in out) / took)
            off, on = median(rates["off"]), median(rates["on"])
            rows.append([name, size, f"{off:.0f}", f"{on:.0f}", f"{100 * (on / off - 1):+.0f}%"])
            print(markdown_table(["model", "requests", "off tok/s", "on tok/s", "cost"],
                                 rows[-1:]), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", ROUTING_PRESET])
    parser.add_argument("--modes", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    print(machine_description())
    if args.throughput:
        rows = []
        for name in args.models:
            rows += throughput(name, args.rounds, args.sizes)
        print(f"\nOutput tokens/s, median of {args.rounds} interleaved rounds, greedy, 64 new "
              "tokens per request, prompts of 8-300 tokens, engine_args() settings:\n")
        print(markdown_table(["model", "requests", "off tok/s", "on tok/s", "cost"], rows))
        return
    rows = []
    for name in args.models:
        for mode in args.modes:
            rows.append(identity(name, mode == "on"))
            print(markdown_table(HEADER, rows[-1:]), flush=True)
    print(f"\n{len(TARGET_LENS)} targets (prompts of {TARGET_LENS} tokens, {MAX_NEW} greedy "
          "tokens) alone vs in 5 varied batches each, overlap on, plus alone and the 5 "
          "batches with overlap off; identical = bitwise equal to the target alone, overlap "
          "on:\n")
    print(markdown_table(HEADER, rows))


HEADER = ["model", "deterministic", "identical (all)", "output ids", "logprobs",
          "routed experts", "max |d logprob|"]

if __name__ == "__main__":
    main()
