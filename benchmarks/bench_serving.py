"""HTTP serving load: request throughput, output tokens/s, TTFT and ITL percentiles.

Streams `/generate` requests from an httpx async client at each concurrency (closed loop:
each of C workers sends its next request when the previous one ends), with and without
routed experts, A/B interleaved. Loopback only; every run is bounded in count and time.

    python benchmarks/bench_serving.py                     # starts its own server
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx
import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(__file__))

from bench_routed_experts import model_path_for  # noqa: E402
from bench_utils import machine_description, markdown_table, random_prompts  # noqa: E402

from sgl_jax.testing import ServerProcess, server_flags  # noqa: E402


def start_server(args: argparse.Namespace) -> ServerProcess:
    # Serving-sized buckets (not the tests' fast settings): these are what is measured.
    bs = sorted({1, 8, 32, 64, *args.concurrency})
    flags = server_flags(enable_return_routed_experts=True, log_level="warning",
                         max_running_requests=max(bs), precompile_bs_paddings=bs,
                         precompile_token_paddings=[64, 256, 1024], chunked_prefill_size=1024,
                         model_path=model_path_for(args.preset))
    return ServerProcess(flags, startup_timeout=900, log_prefix="bench_serving_")


async def one_request(client: httpx.AsyncClient, url: str, ids: list[int], out_len: int,
                      routed: bool) -> dict:
    body = {"input_ids": ids, "stream": True, "return_routed_experts": routed,
            "sampling_params": {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}}
    t0 = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/generate", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("output_ids"):
                times.append(time.perf_counter())
                tokens += len(chunk["output_ids"])
            if routed and chunk["meta_info"].get("finish_reason") is not None:
                assert chunk["meta_info"].get("routed_experts"), "routed experts missing"
    end = time.perf_counter()
    return {"ttft": times[0] - t0, "itl": list(np.diff(times)), "tokens": tokens, "latency": end - t0}


async def run_level(url: str, prompts: list[list[int]], concurrency: int, out_len: int,
                    routed: bool) -> dict:
    queue = list(prompts)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def worker() -> None:
            while queue:
                ids = queue.pop()
                results.append(await one_request(client, url, ids, out_len, routed))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]), 1800)
        wall = time.perf_counter() - t0
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {
        "req_s": len(results) / wall,
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": np.percentile(ttft, 50) * 1e3, "ttft_p99": np.percentile(ttft, 99) * 1e3,
        "itl_p50": np.percentile(itl, 50) * 1e3 if itl else float("nan"),
        "itl_p99": np.percentile(itl, 99) * 1e3 if itl else float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (started with "
                   "--enable-return-routed-experts); default: start one")
    p.add_argument("--preset", default=None, help="make_random_model preset (default: bundled)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests-per-worker", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()

    server = None
    url = args.base_url
    if url is None:
        server = start_server(args)
        url = server.url
    info = httpx.get(f"{url}/get_model_info").json()
    rows = []
    try:
        for c in args.concurrency:
            prompts = random_prompts(c * args.requests_per_worker, args.input_len,
                                     info["vocab_size"], seed=c)
            asyncio.run(run_level(url, prompts[:c], c, 8, False))  # warm-up
            for routed in (False, True):
                r = asyncio.run(run_level(url, prompts, c, args.output_len, routed))
                rows.append([c, "on" if routed else "off", r["req_s"], r["tok_s"], r["ttft_p50"],
                             r["ttft_p99"], r["itl_p50"], r["itl_p99"]])
                print(f"concurrency {c} routed {'on' if routed else 'off'}: {r}", flush=True)
    finally:
        if server is not None:
            server.stop(timeout=30)
    print(f"\n### HTTP serving: {args.preset or 'bundled tiny-qwen3-moe'}, input "
          f"{args.input_len}, output {args.output_len}, {args.requests_per_worker} requests per "
          f"worker, streaming /generate\n")
    print(f"`{' '.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(markdown_table(["concurrency", "routed experts", "req/s", "output tok/s",
                          "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"], rows))


if __name__ == "__main__":
    main()
