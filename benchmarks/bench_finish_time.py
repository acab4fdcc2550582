"""Finish-time cost of routed experts through the real processes and HTTP (M9 item 3).

Run by ``bench_serialization.py --finish`` (or directly). A random checkpoint with Qwen3-30B-A3B's
routing shape (48 layers, 128 experts, top-8) and tiny widths (``make_random_model``), served by
a real server (``sgl_jax.launch_server``: HTTP process, scheduler, detokenizer) on CPU, one per
scenario with as many request slots as the scenario sends at once:

- **long**: one request of ``--long-tokens`` prompt tokens (32k; several sizes may be given, a
  server each, to show the added time is linear in the payload);
- **burst**: ``--burst`` concurrent requests of ``--burst-tokens`` prompt tokens (64 x 8k) that
  finish in the same step.

Requests generate ``--max-new-tokens`` (default 1: they end after their prefill step, with
``seq_len - 1`` = prompt-length rows; a decode step at 32k context costs tens of seconds on a
loaded 2-core CPU and its noise would drown the finish path). Each prompt is first sent once
with routed experts, so its KV and rows are in the prefix cache: the measured requests compute
one token each (their last prompt token), and what differs between asking and not asking is
the finish-time path alone (gather rows [start_len, seq_len-1), scheduler -> detokenizer ->
tokenizer manager transport, base64, the JSON response, the client reading it). Variants
("off": no routed experts; "int32" / "uint8": ``routed_experts_dtype`` in JSON;
"msgpack int32" / "msgpack uint8": the same rows as raw bytes in a MessagePack body, asked for
with ``Accept: application/msgpack``; ", buffered" / ", readinto": how the client reads the
body, see ``Variant``; ``--variants`` picks some, "off" always runs) are interleaved in rounds, order rotated; the figures are
medians. "added" = variant minus off; "paired" = the median over rounds of each round's
variant minus that round's off (adjacent runs, so the machine's drift cancels); "round" is
the time until a round's slowest request is read (its added share, paired likewise). Latency is the client's until the body is read; the
client's decoding into a numpy array (``extract_routed_experts_from_meta_info`` after
``json.loads`` / ``msgpack.unpackb``) is reported beside it.

Peak RSS: each server process's high-water mark is reset (``/proc/PID/clear_refs``) before a
burst round and read (``VmHWM``) after it; reported as the rise over the resident size before
the round, beside the payload (the rows of all requests in the round, in the wire dtype).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import msgpack
import numpy as np
import orjson

from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.testing import ServerProcess, server_flags

LAYERS, TOP_K = 48, 8


class Variant:
    """What a request asks for and how the client reads the body (``reader``):

    - ``content``: httpx's ``response.content`` (httpx joins its 64 KiB reads into a ``bytes``);
    - ``buffered``: httpx streaming the body into one numpy buffer of its Content-Length;
    - ``readinto``: the standard library's ``http.client`` reading the body straight into one
      numpy buffer (``HTTPResponse.readinto``: the socket writes into it, no 64 KiB pieces;
      docs/routed_experts.md)."""

    def __init__(self, dtype: str | None, binary: bool = False, reader: str = "content") -> None:
        self.dtype, self.binary, self.reader = dtype, binary, reader
        self.headers = {"Accept": "application/msgpack"} if binary else {}

    def decode(self, data: bytes) -> np.ndarray | None:
        body = msgpack.unpackb(data) if self.binary else orjson.loads(data)
        return extract_routed_experts_from_meta_info(body)


VARIANTS = {"off": Variant(None), "int32": Variant("int32"), "uint8": Variant("uint8"),
            "msgpack int32": Variant("int32", True), "msgpack uint8": Variant("uint8", True),
            "off, buffered": Variant(None, True, "buffered"),
            "msgpack int32, buffered": Variant("int32", True, "buffered"),
            "off, readinto": Variant(None, True, "readinto"),
            "msgpack int32, readinto": Variant("int32", True, "readinto"),
            "msgpack uint8, readinto": Variant("uint8", True, "readinto")}


def read_into_buffer(response: httpx.Response) -> memoryview:
    """The body of a streamed response, read into one numpy buffer of its Content-Length
    (numpy asks for huge pages for it: no page fault per 4 KiB, unlike a 48 MiB ``bytes``)."""
    buf = np.empty(int(response.headers["content-length"]), np.uint8)
    view, pos = memoryview(buf), 0
    for chunk in response.iter_raw():
        view[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    return view[:pos]


def post_readinto(conn: http.client.HTTPConnection, path: str, body: bytes,
                  headers: dict[str, str]) -> tuple[int, memoryview]:
    """(status, body) of a POST whose body ``http.client`` reads straight into one numpy
    buffer of its Content-Length (the recipe of docs/routed_experts.md)."""
    for attempt in range(2):
        try:
            conn.request("POST", path, body=body,
                         headers={"Content-Type": "application/json", **headers})
            response = conn.getresponse()
            break
        except ConnectionError:  # a kept-alive connection the server closed: reconnect once
            conn.close()
            if attempt:
                raise
    buf = np.empty(int(response.getheader("Content-Length")), np.uint8)
    view, pos = memoryview(buf), 0
    while pos < len(buf):
        n = response.readinto(view[pos:])
        if not n:
            raise ConnectionError(f"the body ended after {pos} of {len(buf)} bytes")
        pos += n
    return response.status, view


def _baseline(variant: Variant) -> str:
    """The variant a variant's added time is taken over: no rows, read the same way."""
    name = "off" if variant.reader == "content" else f"off, {variant.reader}"
    return name if name in VARIANTS else "off"


def make_model(context: int) -> str:
    path = os.path.join(tempfile.gettempdir(), f"sgl_jax_bench_finish_{context}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from sgl_jax.tools.make_random_model import write_random_model

        write_random_model(path, "qwen3-30b-a3b-routing",
                           {"max_position_embeddings": context}, seed=0, check_routing=False)
    return path


def _proc_tree(pid: int) -> dict[str, int]:
    """{role: pid} of the server and its children."""
    out = {"http": pid}
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    for c in children:
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        role = "scheduler" if "scheduler" in cmd else "detokenizer" if "detok" in cmd else str(c)
        out[role] = c
    return out


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _payload(dtype: str | None, rows: int) -> int:
    return 0 if dtype is None else rows * LAYERS * TOP_K * np.dtype(dtype).itemsize


MAX_NEW_TOKENS = [1]  # set from --max-new-tokens


# One client for every request (connections kept alive, enough for a burst's concurrency).
_CLIENT = [httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=256))]


# Kept-alive http.client connections, one per concurrent request (each thread takes its own).
_IDLE: list[http.client.HTTPConnection] = []


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    try:
        conn = _IDLE.pop()
    except IndexError:
        conn = http.client.HTTPConnection(httpx.URL(url).host, httpx.URL(url).port)
    conn.timeout = timeout
    if conn.sock is not None:
        conn.sock.settimeout(timeout)
    return conn


def _generate(url: str, ids: list[int], variant: Variant,
              timeout: float = 600) -> tuple[float, float]:
    """(seconds until the body is read, seconds the client then takes to decode the rows)."""
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {
        "max_new_tokens": MAX_NEW_TOKENS[0], "temperature": 0.0, "ignore_eos": True}}
    if variant.dtype is not None:
        body.update(return_routed_experts=True, routed_experts_dtype=variant.dtype)
    t0 = time.perf_counter()
    if variant.reader == "readinto":
        conn = _connection(url, timeout)
        status, data = post_readinto(conn, "/generate", orjson.dumps(body), variant.headers)
        _IDLE.append(conn)
    elif variant.reader == "buffered":
        with _CLIENT[0].stream("POST", url + "/generate", json=body, headers=variant.headers,
                               timeout=timeout) as r:
            assert r.status_code == 200, r.read()[:500]
            status, data = r.status_code, read_into_buffer(r)
    else:
        r = _CLIENT[0].post(url + "/generate", json=body, headers=variant.headers,
                            timeout=timeout)
        status, data = r.status_code, r.content
    secs = time.perf_counter() - t0
    assert status == 200, bytes(data[:500])
    rows = variant.decode(data)
    decode = time.perf_counter() - t0 - secs
    if variant.dtype is not None:
        assert rows is not None and rows.dtype == np.dtype(variant.dtype)
        assert rows.shape[0] == len(ids) + MAX_NEW_TOKENS[0] - 1
    return secs, decode


def _round(url: str, prompt: list[int], n: int, variant: Variant) -> list[tuple[float, float]]:
    if n == 1:
        return [_generate(url, prompt, variant)]
    with cf.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _generate(url, prompt, variant), range(n)))


def run(args: argparse.Namespace) -> list[str]:
    MAX_NEW_TOKENS[0] = args.max_new_tokens
    for name in set(VARIANTS) - {"off", *args.variants}:
        del VARIANTS[name]
    context = max(args.long_tokens + [args.burst_tokens]) + 64
    path = make_model(context)
    vocab = 512
    rng = np.random.default_rng(0)
    lines: list[str] = []
    scenarios = []
    if "long" in args.scenarios:
        scenarios += [("long", rng.integers(10, vocab, t).tolist(), 1) for t in args.long_tokens]
    if "burst" in args.scenarios:
        scenarios.append(("burst", rng.integers(10, vocab, args.burst_tokens).tolist(),
                          args.burst))
    for name, prompt, n in scenarios:
        # One server per scenario, its running requests capped at the scenario's concurrency:
        # the native attention sizes an extend's query blocks from the padded rows of the
        # batch, and a group's KV loop costs all its blocks, padding ones included, so a
        # one-token extend at 32k context costs ~60x more with 64 request slots than with 1.
        flags = server_flags(
            model_path=path, enable_return_routed_experts=True, context_length=context,
            chunked_prefill_size=args.chunk, precompile_token_paddings=[64, args.chunk],
            precompile_bs_paddings=sorted({1, n}), max_running_requests=n,
            # Room for the prompt's cached KV and the requests' reservations, so that no
            # round evicts the prompt (a 32k-token prefill takes minutes on a CPU).
            max_total_tokens=len(prompt) + n * 512 + 4096,
            disable_precompile=True,
            routed_experts_shm_mb=args.routed_experts_shm_mb,
            log_level="warning",
        )
        server = ServerProcess(flags, startup_timeout=600)
        try:
            procs = _proc_tree(server.proc.pid)
            t0 = time.perf_counter()
            # rows into the prefix cache
            _generate(server.url, prompt, Variant("int32"), timeout=3600)
            print(f"{name}: warm-up prefill of {len(prompt)} tokens {time.perf_counter() - t0:.0f}"
                  " s", flush=True)
            for variant in VARIANTS.values():  # compile every shape the rounds use
                _round(server.url, prompt, n, variant)
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            round_medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
            round_walls: dict[str, list[float]] = {v: [] for v in VARIANTS}  # slowest request
            decodes: dict[str, list[float]] = {v: [] for v in VARIANTS}
            peaks: dict[str, dict[str, list[int]]] = {v: {r: [] for r in procs} for v in VARIANTS}
            order = list(VARIANTS)
            for i in range(args.repeats):
                for v in order[i % len(order):] + order[: i % len(order)]:
                    before = {r: _status(p, "VmRSS") for r, p in procs.items()}
                    for p in procs.values():
                        _reset_peak(p)
                    results = _round(server.url, prompt, n, VARIANTS[v])
                    for secs, decode in results:
                        times[v].append(secs)
                        decodes[v].append(decode)
                    round_medians[v].append(statistics.median(s for s, _ in results))
                    round_walls[v].append(max(s for s, _ in results))
                    print(f"{name} round {i} {v}: p50 {statistics.median(times[v][-n:]) * 1e3:.0f}"
                          " ms", flush=True)
                    for r, p in procs.items():
                        peaks[v][r].append(_status(p, "VmHWM") - before[r])
        finally:
            server.stop()
        rows = len(prompt) + args.max_new_tokens - 1  # seq_len - 1
        lines.append(f"\n**{name}**: {n} request(s) x {len(prompt)} prompt tokens, "
                     f"{args.repeats} rounds\n")
        lines.append("| variant | payload / request | latency p50 ms | max ms | baseline | "
                     "added p50 ms | added, paired p50 ms | paired ms / MiB | round p50 ms | "
                     "round added, paired | client decode p50 ms | "
                     + " | ".join(f"peak RSS rise {r} MiB" for r in procs) + " |")
        lines.append("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"
                     + "---:|" * len(procs))
        for v, variant in VARIANTS.items():
            med = statistics.median(times[v]) * 1e3
            base = _baseline(variant)
            off = statistics.median(times[base]) * 1e3
            # Each round's median minus the same round's baseline (run next to it): the drift
            # of this machine's speed between rounds cancels.
            paired = statistics.median(
                a - b for a, b in zip(round_medians[v], round_medians[base], strict=True)) * 1e3
            # A round lasts until its slowest request is read: its added time, paired, as a
            # share of the baseline's round.
            wall = statistics.median(round_walls[v]) * 1e3
            wall_added = statistics.median(
                (a - b) / b for a, b in zip(round_walls[v], round_walls[base], strict=True))
            mib = _payload(variant.dtype, rows) / 2**20
            per_mib = f"{paired / mib:+.2f}" if mib else "-"
            peak = " | ".join(f"{max(peaks[v][r]) / 2**20:.0f}" for r in procs)
            lines.append(f"| {v} | {mib:.1f} MiB | {med:.1f} | {max(times[v]) * 1e3:.1f} | "
                         f"{base} | {med - off:+.1f} | {paired:+.1f} | {per_mib} | "
                         f"{wall:.1f} | {wall_added:+.1%} | "
                         f"{statistics.median(decodes[v]) * 1e3:.1f} | {peak} |")
        print("\n".join(lines[-(len(VARIANTS) + 3):]), flush=True)
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--long-tokens", type=int, nargs="+", default=[32768],
                   help="prompt tokens of the long scenario (a server and table per size)")
    p.add_argument("--scenarios", nargs="+", choices=["long", "burst"],
                   default=["long", "burst"])
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--burst-tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096, help="chunked prefill size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the variants to run (\"off\", the baseline, always runs)")
    p.add_argument("--routed-experts-shm-mb", type=int, default=1024,
                   help="the server's shared memory for large rows (0: the socket side channel)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    print(f"`python {' '.join(sys.argv)}`")
    print("\n".join(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
