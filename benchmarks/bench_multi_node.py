"""One process on 4 devices vs two processes of 2 devices (a multi-node job on loopback).

    python benchmarks/bench_multi_node.py [--requests 8] [--new-tokens 32] [--rounds 5]

Both serve the bundled model with tp 2 x ep 2 and routed experts on (the multi-node tests'
layout). Reports the start-up time (launch to healthy, precompilation included; the
persistent compilation cache is off, so both compile everything) and the decode throughput of
``--requests`` greedy requests of ``--new-tokens`` tokens sent as one batch, the median of
``--rounds`` rounds after a warm-up, rounds interleaved between the two servers. For scale
only: on this machine both "hosts" share two CPU cores, and gloo over loopback stands in for
a TPU slice's interconnect.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sgl_jax.testing import MultiNodeJob, ServerProcess, server_flags

LAYOUT = dict(tp_size=2, ep_size=2, enable_return_routed_experts=True,
              precompile_bs_paddings=[1, 2, 4, 8], precompile_token_paddings=[64, 256])


def tokens_per_second(server: ServerProcess, requests: int, new_tokens: int) -> float:
    prompts = [[(7 * i + j) % 400 + 10 for j in range(16)] for i in range(requests)]
    t0 = time.perf_counter()
    res = server.post("/generate", timeout=600, json={
        "input_ids": prompts, "return_routed_experts": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                            "ignore_eos": True}})
    elapsed = time.perf_counter() - t0
    res.raise_for_status()
    return sum(out["meta_info"]["completion_tokens"] for out in res.json()) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    flags = server_flags(**LAYOUT, compilation_cache_dir="", log_level="warning")

    t0 = time.perf_counter()
    single = ServerProcess(flags, env={
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        startup_timeout=600)
    startup = {"1 process x 4 devices": time.perf_counter() - t0}
    t0 = time.perf_counter()
    job = MultiNodeJob(flags, startup_timeout=600)
    startup["2 processes x 2 devices"] = time.perf_counter() - t0
    servers = {"1 process x 4 devices": single, "2 processes x 2 devices": job.leader}
    try:
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for server in servers.values():  # warm-up
            tokens_per_second(server, args.requests, args.new_tokens)
        for _ in range(args.rounds):
            for name, server in servers.items():
                rates[name].append(tokens_per_second(server, args.requests, args.new_tokens))
    finally:
        single.stop()
        job.stop()
    base = statistics.median(rates["1 process x 4 devices"])
    print(f"{args.requests} requests x {args.new_tokens} new tokens, median of "
          f"{args.rounds} rounds")
    print("| run | start-up (s) | tokens/s | vs 1 process |")
    print("|---|---:|---:|---:|")
    for name in servers:
        rate = statistics.median(rates[name])
        print(f"| {name} | {startup[name]:.1f} | {rate:.1f} | {rate / base:.2f} |")


if __name__ == "__main__":
    main()
