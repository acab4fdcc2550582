"""Soak: a bounded mixed load against a real server, then proof that nothing was lost or leaked.

    python benchmarks/bench_soak.py --requests 1000 --concurrency 64     # starts its own server
    python benchmarks/bench_soak.py --base-url http://127.0.0.1:30000    # a running server

Requests draw from a pool of distinct (prompt, max_tokens) pairs (greedy, ``ignore_eos``, so
every result is deterministic): mixed prompt and output lengths, ``/generate`` and
``/v1/completions``, streaming and not, some asking for routed experts, some cancelled by the
client (disconnect after a random short delay). Afterwards:

- every completed copy equals what its pair gives ALONE (output ids or text, token counts,
  routed-experts rows when asked, none when not); each pair's alone-result is computed once,
  sequentially, after the soak; a sample of pairs is also checked against the independent
  float64 reference forward (``sgl_jax.tools.reference_forward``);
- every cancelled ``/generate`` rid is unknown to the server, and within a second of the last
  client finishing no request is running or queued, no KV slot is locked, free + evictable KV
  slots are all slots, and every request slot is free;
- the resident memory of the server's processes grew by at most ``--rss-bound-mib`` between
  a warm-up and the end.

It prints the figures and exits non-zero on any failure, mismatch or leak. The test suite runs
a small version through :func:`soak` (``tests/test_reliability.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
import psutil
import pybase64

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_utils import machine_description, markdown_table  # noqa: E402

from sgl_jax.testing import ServerProcess, server_flags  # noqa: E402

# The bundled model's vocabulary ends with special tokens; stay below them.
PROMPT_VOCAB = 500
MIB = 1024 * 1024


@dataclass
class SoakConfig:
    requests: int = 1000
    concurrency: int = 64
    pool: int = 40  # distinct (prompt, max_tokens) pairs
    max_prompt: int = 1200  # a few prompts above the chunk size are prefilled in chunks
    max_output: int = 96
    stream_fraction: float = 0.5
    routed_fraction: float = 0.5
    cancel_fraction: float = 0.2
    completions_fraction: float = 0.25  # the rest go to /generate
    # Seconds, uniform. At concurrency 64 here a request takes about a second: some
    # cancellations come while queued or prefilling, most while decoding, a few too late.
    cancel_delay: tuple[float, float] = (0.0, 1.0)
    warmup_requests: int | None = None  # default: 2 * concurrency
    reference_sample: int = 4  # pairs also checked against the float64 reference
    rss_bound_mib: float = 64.0  # total growth allowed over all server processes
    request_timeout: float = 120.0
    deadline: float = 1800.0  # the whole soak phase
    idle_timeout: float = 1.0  # slots must be free this soon after the last client finished
    seed: int = 0


@dataclass(frozen=True)
class Pair:
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class SoakRequest:
    pair: int
    route: str  # "/generate" or "/v1/completions"
    stream: bool
    routed: bool
    cancel_after: float | None  # seconds after sending; None: never cancelled
    rid: str  # /generate only (the OpenAI routes name their own ids)


@dataclass
class Outcome:
    req: SoakRequest
    status: str  # "completed" | "cancelled" | "failed"
    text: str = ""
    output_ids: list[int] | None = None  # /generate only
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    pieces: int = 0  # bodies or stream chunks received
    routed: bytes | None = None  # routed-experts bytes so far (a stream's chunks carry runs)


@dataclass
class Report:
    config: SoakConfig
    outcomes: list[Outcome]
    failures: list[str]
    mismatches: list[str]
    leaks: list[str]
    rss_before: dict[str, int]
    rss_after: dict[str, int]
    wall: float
    server_delta: dict[str, int]

    @property
    def completed(self) -> int:
        return sum(o.status == "completed" for o in self.outcomes)

    @property
    def cancelled(self) -> int:
        return sum(o.status == "cancelled" for o in self.outcomes)

    @property
    def cancelled_mid_stream(self) -> int:
        """Cancelled streams that had received text (so were decoding when their client left)."""
        return sum(o.status == "cancelled" and o.pieces > 0 for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not (self.failures or self.mismatches or self.leaks)


# -- workload -------------------------------------------------------------------------------------
def make_pool(n: int, max_prompt: int, max_output: int, seed: int) -> list[Pair]:
    """Distinct pairs: mostly short and medium prompts, a tenth long ones (prefilled in
    chunks); log-uniform output lengths, a seventh of them long."""
    rng = np.random.default_rng(seed)
    pairs: list[Pair] = []
    for i in range(n):
        if i % 10 == 9:
            length = int(rng.integers(max(max_prompt // 2, 1), max_prompt + 1))
        else:
            length = int(np.exp(rng.uniform(0, np.log(min(max_prompt, 300)))))
        if i % 7 == 6:
            out = int(rng.integers(max(max_output // 2, 1), max_output + 1))
        else:
            out = int(np.exp(rng.uniform(0, np.log(max_output))))
        ids = tuple(int(t) for t in rng.integers(0, PROMPT_VOCAB, max(length, 1)))
        pairs.append(Pair(prompt_ids=ids, max_tokens=max(out, 1)))
    return pairs


def make_requests(cfg: SoakConfig, n: int, seed: int) -> list[SoakRequest]:
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(n):
        cancel = rng.random() < cfg.cancel_fraction
        reqs.append(SoakRequest(
            pair=int(rng.integers(cfg.pool)),
            route="/v1/completions" if rng.random() < cfg.completions_fraction else "/generate",
            stream=bool(rng.random() < cfg.stream_fraction),
            routed=bool(rng.random() < cfg.routed_fraction),
            cancel_after=float(rng.uniform(*cfg.cancel_delay)) if cancel else None,
            rid=f"soak-{uuid.uuid4().hex}",
        ))
    return reqs


def request_body(req: SoakRequest, pair: Pair) -> dict[str, Any]:
    if req.route == "/generate":
        return {"input_ids": list(pair.prompt_ids), "rid": req.rid, "stream": req.stream,
                "return_routed_experts": req.routed,
                "sampling_params": {"max_new_tokens": pair.max_tokens, "temperature": 0.0,
                                    "ignore_eos": True}}
    return {"prompt": list(pair.prompt_ids), "max_tokens": pair.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": req.stream, "return_routed_experts": req.routed}


# -- one request ----------------------------------------------------------------------------------
def _absorb(out: Outcome, piece: dict[str, Any]) -> None:
    """Adds one response body or stream chunk (either route) to ``out``."""
    if "error" in piece:
        raise RuntimeError(f"error event: {piece['error']}")
    out.pieces += 1
    if out.req.route == "/generate":
        out.text += piece["text"]
        out.output_ids = (out.output_ids or []) + piece["output_ids"]
        meta = piece["meta_info"]
    elif not piece.get("choices"):  # the chunk that carries the whole sglext
        return
    else:
        choice = piece["choices"][0]
        out.text += choice["text"]
        meta = choice.get("meta_info") or {}
    if meta.get("routed_experts") is not None:
        out.routed = (out.routed or b"") + pybase64.b64decode(meta["routed_experts"])
    if meta.get("finish_reason") is not None:
        out.meta = dict(meta)
        if out.routed is not None:  # every chunk's rows, in order: the whole request's
            out.meta["routed_experts"] = pybase64.b64encode(out.routed).decode("ascii")


async def _send(client: httpx.AsyncClient, url: str, out: Outcome, pair: Pair) -> Outcome:
    """Fills ``out`` as the response arrives (so a cancelled stream keeps what it received)."""
    req = out.req
    body = request_body(req, pair)
    if not req.stream:
        resp = await client.post(url + req.route, json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        _absorb(out, orjson.loads(resp.content))
        return out
    async with client.stream("POST", url + req.route, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            _absorb(out, orjson.loads(line[6:]))
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
    return out


async def run_one(client: httpx.AsyncClient, url: str, req: SoakRequest, pair: Pair) -> Outcome:
    """Sends ``req``; a request to be cancelled is abandoned (its connection closed) after its
    delay, unless it finished first, in which case it counts as completed."""
    out = Outcome(req=req, status="completed")
    task = asyncio.ensure_future(_send(client, url, out, pair))
    try:
        await asyncio.wait({task}, timeout=req.cancel_after)
    finally:
        if not task.done():
            task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if req.cancel_after is None:
            raise
        out.status = "cancelled"
        return out
    except Exception as e:  # noqa: BLE001 - every other error is a failure to report
        return Outcome(req=req, status="failed", error=f"{type(e).__name__}: {e}")


async def run_load(url: str, reqs: list[SoakRequest], pairs: list[Pair], concurrency: int,
                   request_timeout: float, deadline: float) -> list[Outcome]:
    """Closed loop: ``concurrency`` workers, each sending its next request when one ends."""
    todo = list(enumerate(reqs))
    todo.reverse()
    results: list[Outcome | None] = [None] * len(reqs)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            while todo:
                i, req = todo.pop()
                results[i] = await run_one(client, url, req, pairs[req.pair])

        await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]), deadline)
    return [r for r in results if r is not None]


# -- checks ---------------------------------------------------------------------------------------
def decode_rows(meta: dict[str, Any], info: dict[str, Any]) -> np.ndarray | None:
    encoded = meta.get("routed_experts")
    if encoded is None:
        return None
    flat = np.frombuffer(pybase64.b64decode(encoded.encode("ascii"), validate=True), dtype="<i4")
    return flat.reshape(-1, info["num_hidden_layers"], info["num_experts_per_tok"])


def alone_results(url: str, pairs: list[Pair], indices: list[int]) -> dict[int, Outcome]:
    """Each pair once, sequentially (nothing else running), with routed experts."""
    out = {}
    with httpx.Client(timeout=120.0) as client:
        for i in indices:
            req = SoakRequest(pair=i, route="/generate", stream=False, routed=True,
                              cancel_after=None, rid=f"alone-{uuid.uuid4().hex}")
            resp = client.post(url + "/generate", json=request_body(req, pairs[i]))
            resp.raise_for_status()
            o = Outcome(req=req, status="completed")
            _absorb(o, resp.json())
            out[i] = o
    return out


def compare(o: Outcome, alone: Outcome, pair: Pair, info: dict[str, Any]) -> str | None:
    """Why the completed ``o`` differs from its pair's alone-result (None if it does not)."""
    meta = o.meta
    reason = meta.get("finish_reason")
    kind = reason if isinstance(reason, str) else (reason or {}).get("type")
    if kind != "length" or meta.get("completion_tokens") != pair.max_tokens:
        return f"finished with {reason!r} after {meta.get('completion_tokens')} tokens"
    if meta.get("prompt_tokens") != len(pair.prompt_ids):
        return f"prompt_tokens {meta.get('prompt_tokens')} != {len(pair.prompt_ids)}"
    if o.output_ids is not None and o.output_ids != alone.output_ids:
        pairs_ = zip(o.output_ids, alone.output_ids or [], strict=False)
        first = next((i for i, (a, b) in enumerate(pairs_) if a != b), len(o.output_ids))
        return f"output ids differ from the alone-result at position {first}"
    if o.text != alone.text:
        return "text differs from the alone-result"
    rows = decode_rows(meta, info)
    if not o.req.routed:
        return None if rows is None else "routed experts returned without being asked for"
    if rows is None:
        return "routed experts asked for but missing"
    if not np.array_equal(rows, decode_rows(alone.meta, info)):
        return "routed-experts rows differ from the alone-result"
    return None


def check_reference(info: dict[str, Any], pairs: list[Pair], alone: dict[int, Outcome],
                    indices: list[int]) -> list[str]:
    """The alone-results of ``indices`` against the independent float64 reference forward."""
    from sgl_jax.tools.reference_forward import ReferenceModel, routed_experts_rows

    ref = ReferenceModel(info["model_path"])
    problems = []
    for i in indices:
        ids, a = list(pairs[i].prompt_ids), alone[i]
        if ref.greedy_generate(ids, pairs[i].max_tokens) != a.output_ids:
            problems.append(f"pair {i}: output ids differ from the reference forward")
        elif not np.array_equal(decode_rows(a.meta, info),
                                routed_experts_rows(ref, ids, a.output_ids)):
            problems.append(f"pair {i}: routed experts differ from the reference forward")
    return problems


def slot_leaks(info: dict[str, Any]) -> list[str]:
    problems = []
    if info["num_running_reqs"] or info["num_waiting_reqs"]:
        problems.append(f"{info['num_running_reqs']} running / {info['num_waiting_reqs']} "
                        "waiting requests")
    if info["locked_kv_slots"]:
        problems.append(f"{info['locked_kv_slots']} locked KV slots")
    if info["available_kv_slots"] + info["evictable_kv_slots"] != info["total_kv_slots"]:
        problems.append(f"KV slots: {info['available_kv_slots']} free + "
                        f"{info['evictable_kv_slots']} evictable != {info['total_kv_slots']}")
    if info["free_req_slots"] != info["total_req_slots"]:
        problems.append(f"request slots: {info['free_req_slots']} free of "
                        f"{info['total_req_slots']}")
    return problems


def wait_idle(url: str, timeout: float) -> list[str]:
    """The slot leaks still present ``timeout`` seconds from now (polling; [] when idle)."""
    deadline = time.monotonic() + timeout
    while True:
        problems = slot_leaks(httpx.get(url + "/get_server_info", timeout=30).json())
        if not problems or time.monotonic() >= deadline:
            return problems
        time.sleep(0.02)


def server_rss(url: str) -> dict[str, int]:
    """Resident bytes of the server process and its children, by role."""
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    pids = {"server": info["pid"], **info["pids"]}
    return {role: psutil.Process(pid).memory_info().rss for role, pid in pids.items()}


# -- the soak -------------------------------------------------------------------------------------
def describe(o: Outcome) -> str:
    r = o.req
    return f"{r.route} stream={r.stream} routed={r.routed} pair={r.pair} rid={r.rid}"


def soak(url: str, cfg: SoakConfig, log: Callable[[str], None] = print) -> Report:
    """Runs the whole soak against the server at ``url`` and returns what it found."""
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    if not info["enable_return_routed_experts"]:
        raise SystemExit("the server must run with --enable-return-routed-experts")
    pairs = make_pool(cfg.pool, cfg.max_prompt, cfg.max_output, cfg.seed)
    context = info["context_length"]
    if max(len(p.prompt_ids) + p.max_tokens for p in pairs) > context:
        raise SystemExit(f"--max-prompt + --max-output exceed the context length {context}")

    # Warm-up: the same mix, so allocator pools and caches reach their steady size first.
    warm = make_requests(cfg, cfg.warmup_requests or 2 * cfg.concurrency, cfg.seed + 1)
    warmed = asyncio.run(run_load(url, warm, pairs, cfg.concurrency, cfg.request_timeout,
                                  cfg.deadline))
    failures = [f"warm-up {describe(o)}: {o.error}" for o in warmed if o.status == "failed"]
    leaks = [f"after the warm-up: {p}" for p in wait_idle(url, cfg.idle_timeout)]
    rss_before = server_rss(url)
    stats_before = httpx.get(url + "/get_server_info", timeout=30).json()

    reqs = make_requests(cfg, cfg.requests, cfg.seed + 2)
    log(f"soak: {cfg.requests} requests at concurrency {cfg.concurrency} against {url}")
    t0 = time.perf_counter()
    outcomes = asyncio.run(run_load(url, reqs, pairs, cfg.concurrency, cfg.request_timeout,
                                    cfg.deadline))
    wall = time.perf_counter() - t0
    leaks += wait_idle(url, cfg.idle_timeout)
    stats_after = httpx.get(url + "/get_server_info", timeout=30).json()
    for o in outcomes:  # the server must have forgotten every cancelled rid
        if o.status == "cancelled" and o.req.route == "/generate":
            gone = httpx.post(url + "/abort_request", json={"rid": o.req.rid}, timeout=30).json()
            if gone["success"]:
                leaks.append(f"cancelled request {o.req.rid} is still tracked by the server")

    failures += [f"{describe(o)}: {o.error}" for o in outcomes if o.status == "failed"]
    used = sorted({o.req.pair for o in outcomes if o.status == "completed"})
    log(f"soak: {wall:.1f}s; computing {len(used)} alone-results")
    alone = alone_results(url, pairs, used)
    mismatches = []
    for o in outcomes:
        if o.status == "completed":
            why = compare(o, alone[o.req.pair], pairs[o.req.pair], info)
            if why:
                mismatches.append(f"{describe(o)}: {why}")
    sample = used[:: max(1, len(used) // max(cfg.reference_sample, 1))][: cfg.reference_sample]
    mismatches += check_reference(info, pairs, alone, sample)
    leaks += wait_idle(url, cfg.idle_timeout)
    rss_after = server_rss(url)
    growth = (sum(rss_after.values()) - sum(rss_before.values())) / MIB
    if growth > cfg.rss_bound_mib:
        leaks.append(f"server RSS grew by {growth:.1f} MiB (bound {cfg.rss_bound_mib} MiB)")
    delta = {k: stats_after[k] - stats_before[k]
             for k in ("num_generated_tokens", "num_retractions", "num_compiles")}
    return Report(cfg, outcomes, failures, mismatches, leaks, rss_before, rss_after, wall, delta)


def format_report(r: Report) -> str:
    figures = markdown_table(
        ["requests", "concurrency", "completed", "cancelled (mid-stream)", "failures",
         "mismatches", "leaks", "wall s", "req/s", "output tokens", "retractions", "recompiles"],
        [[len(r.outcomes), r.config.concurrency, r.completed,
          f"{r.cancelled} ({r.cancelled_mid_stream})", len(r.failures),
          len(r.mismatches), len(r.leaks), r.wall, len(r.outcomes) / r.wall,
          r.server_delta["num_generated_tokens"], r.server_delta["num_retractions"],
          r.server_delta["num_compiles"]]],
    )
    rss = markdown_table(
        ["process", "RSS before MiB", "RSS after MiB", "growth MiB"],
        [[role, r.rss_before[role] / MIB, r.rss_after[role] / MIB,
          (r.rss_after[role] - r.rss_before[role]) / MIB] for role in r.rss_before]
        + [["total", sum(r.rss_before.values()) / MIB, sum(r.rss_after.values()) / MIB,
            (sum(r.rss_after.values()) - sum(r.rss_before.values())) / MIB]],
    )
    lines = [figures, "", rss]
    for title, items in (("failures", r.failures), ("mismatches", r.mismatches),
                         ("leaks", r.leaks)):
        if items:
            lines += ["", f"{title} ({len(items)}):", *[f"  - {x}" for x in items[:20]]]
    return "\n".join(lines)


# -- running it -----------------------------------------------------------------------------------
def start_server(concurrency: int, extra: list[str]) -> ServerProcess:
    """The tests' fast settings, with room for ``concurrency`` requests."""
    flags = server_flags(enable_return_routed_experts=True, log_level="warning",
                         max_running_requests=concurrency,
                         precompile_bs_paddings=sorted({1, 4, 16, concurrency}))
    return ServerProcess([*flags, *extra], startup_timeout=600, log_prefix="bench_soak_")


def main() -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (with "
                   "--enable-return-routed-experts) on this machine; default: start one")
    p.add_argument("--server-args", default="", help="extra flags for the started server")
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--pool", type=int, default=d.pool, help="distinct (prompt, max_tokens) pairs")
    p.add_argument("--max-prompt", type=int, default=d.max_prompt)
    p.add_argument("--max-output", type=int, default=d.max_output)
    p.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction)
    p.add_argument("--cancel-delay", type=float, nargs=2, default=d.cancel_delay,
                   metavar=("MIN", "MAX"), help="seconds before a cancelled client disconnects")
    p.add_argument("--reference-sample", type=int, default=d.reference_sample)
    p.add_argument("--rss-bound-mib", type=float, default=d.rss_bound_mib)
    p.add_argument("--seed", type=int, default=d.seed)
    args = p.parse_args()
    cfg = SoakConfig(requests=args.requests, concurrency=args.concurrency, pool=args.pool,
                     max_prompt=args.max_prompt, max_output=args.max_output,
                     cancel_fraction=args.cancel_fraction, cancel_delay=tuple(args.cancel_delay),
                     reference_sample=args.reference_sample, rss_bound_mib=args.rss_bound_mib,
                     seed=args.seed)
    server, url = None, args.base_url
    if url is None:
        server = start_server(cfg.concurrency, args.server_args.split())
        url = server.url
        print(f"server log: {server.log_path}", flush=True)
    try:
        report = soak(url, cfg, log=lambda s: print(s, flush=True))
        alive = httpx.get(url + "/health_generate", timeout=60).status_code == 200
    finally:
        code = None if server is None else server.stop(timeout=30)
    if not alive:
        report.failures.append("the server failed /health_generate after the soak")
    if code not in (None, 0):
        report.failures.append(f"the server exited with code {code} on SIGTERM")
    print(f"\n### Soak: bundled tiny-qwen3-moe, {cfg.requests} requests, concurrency "
          f"{cfg.concurrency}, pool {cfg.pool}, cancel {cfg.cancel_fraction:.0%}\n")
    print(f"`{shlex.join(['python', *sys.argv])}` — {machine_description()}\n")
    print(format_report(report))
    print("\nRESULT:", "PASS" if report.ok else "FAIL")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
