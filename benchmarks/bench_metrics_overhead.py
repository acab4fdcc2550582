"""What --enable-metrics (and --log-requests) costs a serving run: an interleaved A/B.

Two servers with the same flags but the observer (A: both off; B: --enable-metrics
--log-requests, with /metrics scraped every ``--scrape-interval`` seconds during the load, far
more often than Prometheus would), each given the same streaming /generate load in turn
(A, B, A, B, ...: the machine is noisy), through bench_serving's closed-loop client. Prints
the median of each figure per arm and B/A.

    python benchmarks/bench_metrics_overhead.py --rounds 5 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading

import httpx

sys.path.insert(0, os.path.dirname(__file__))

from bench_routed_experts import model_path_for  # noqa: E402
from bench_serving import run_level  # noqa: E402
from bench_utils import machine_description, markdown_table, median, random_prompts  # noqa: E402

from sgl_jax.testing import ServerProcess, server_flags  # noqa: E402

FIGURES = ("req_s", "tok_s", "ttft_p50", "itl_p50", "itl_p99")


def start(args: argparse.Namespace, observed: bool) -> ServerProcess:
    flags = server_flags(enable_return_routed_experts=True, log_level="warning",
                         max_running_requests=max(8, args.concurrency),
                         precompile_bs_paddings=sorted({1, 8, args.concurrency}),
                         precompile_token_paddings=[64, 256], chunked_prefill_size=256,
                         enable_metrics=observed, log_requests=observed,
                         model_path=model_path_for(args.preset))
    return ServerProcess(flags, startup_timeout=900, log_prefix="bench_metrics_")


def scrape_while(url: str, interval: float, stop: threading.Event, count: list[int]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.wait(interval):
            res = client.get(f"{url}/metrics")
            res.raise_for_status()
            count[0] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32, help="per round and arm")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    args = p.parse_args()

    servers = {"off": start(args, False), "on": start(args, True)}
    results: dict[str, list[dict]] = {"off": [], "on": []}
    scrapes = [0]
    try:
        vocab = httpx.get(f"{servers['off'].url}/get_model_info").json()["vocab_size"]
        for server in servers.values():  # warm-up
            asyncio.run(run_level(server.url, random_prompts(args.concurrency, args.input_len,
                                                             vocab, seed=99),
                                  args.concurrency, 8, True))
        for r in range(args.rounds):
            prompts = random_prompts(args.requests, args.input_len, vocab, seed=r)
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                stop = threading.Event()
                scraper = None
                if name == "on":
                    scraper = threading.Thread(target=scrape_while, args=(
                        servers[name].url, args.scrape_interval, stop, scrapes))
                    scraper.start()
                try:
                    out = asyncio.run(run_level(servers[name].url, prompts, args.concurrency,
                                                args.output_len, True))
                finally:
                    stop.set()
                    if scraper is not None:
                        scraper.join()
                results[name].append(out)
                print(f"round {r} {name}: " + ", ".join(f"{k} {out[k]:.2f}" for k in FIGURES),
                      flush=True)
    finally:
        for server in servers.values():
            server.stop(timeout=30)
    rows = []
    for key, label in zip(FIGURES, ("req/s", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
                                    "ITL p99 ms"), strict=True):
        off = median([x[key] for x in results["off"]])
        on = median([x[key] for x in results["on"]])
        rows.append([label, off, on, on / off])
    print(f"\n### Metrics overhead: {args.preset or 'bundled tiny-qwen3-moe'}, concurrency "
          f"{args.concurrency}, {args.requests} streaming /generate requests per round and arm "
          f"(routed experts on), input {args.input_len}, output {args.output_len}; medians of "
          f"{args.rounds} interleaved rounds; B scraped /metrics {scrapes[0]} times "
          f"(every {args.scrape_interval} s)\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(["figure", "A: metrics off", "B: --enable-metrics --log-requests",
                          "B/A"], rows))


if __name__ == "__main__":
    main()
