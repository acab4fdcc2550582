"""Where the finish path's milliseconds go after the tokenizer manager: the HTTP leg alone.

The finish benchmark (``bench_finish_time.py``) times a whole request, whose compute on this
CPU (a one-token extend over a cached prompt: 0.3-5 s) is noisier than the payload's cost.
This one times the legs of the path without the model, for a payload of ``--tokens`` rows x 48
layers x top-8 int32 (Qwen3-30B-A3B's routing shape), each against the same leg without rows:

- ``zmq hop``: one message with the rows out of band, sent and received over a real ``ipc://``
  PUSH/PULL pair with ``sgl_jax.srt.managers.transport`` (the path has two: scheduler ->
  detokenizer -> tokenizer manager);
- ``http json`` / ``http msgpack``: a real uvicorn server in its own process, with the server's
  own h11 protocol and response code (``http_transport._respond``, ``wire.JSON_WIRE`` /
  ``MSGPACK_WIRE``), answering a body built from rows it holds (base64 + orjson for JSON; the
  spliced MessagePack body), read by an httpx client; the figure is the added latency over the
  same response without rows, the client's read of the body included;
- ``client decode``: the client turning the body into a numpy array
  (``extract_routed_experts_from_meta_info`` after ``orjson.loads`` / ``msgpack.unpackb``);
- ``socket floor``: the same bytes over a plain loopback socket into a preallocated buffer, the
  least any HTTP client could pay here, and with 64 KiB reads joined (what Python clients do).

Variants are interleaved, medians of ``--repeats``.

    python benchmarks/bench_http_body.py [--tokens 8192 32768] [--repeats 11]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import httpx
import msgpack
import numpy as np
import orjson
import zmq

from sgl_jax.srt.managers.transport import recv_obj, send_obj
from sgl_jax.srt.routed_experts_codec import extract_routed_experts_from_meta_info
from sgl_jax.srt.utils import free_port

LAYERS, TOP_K = 48, 8

_SERVER = """
import sys
import numpy as np
import uvicorn
from fastapi import FastAPI
from sgl_jax.srt.entrypoints.http_connections import guarded_h11_protocol
from sgl_jax.srt.entrypoints.http_transport import _respond
from sgl_jax.srt.entrypoints.wire import JSON_WIRE, MSGPACK_WIRE
from sgl_jax.srt.routed_experts_codec import encode_routed_experts

rows = np.random.default_rng(0).integers(0, 128, (int(sys.argv[1]), 48, 8), dtype=np.int32)
app = FastAPI()


@app.post("/{kind}")
async def answer(kind: str):
    # As the tokenizer manager hands it over: a fresh array per request (it arrived in a
    # message), base64-encoded for JSON.
    fresh = rows.copy()
    if kind == "off":
        return _respond(JSON_WIRE.dumps({"text": "a", "meta_info": {}}), JSON_WIRE)
    if kind == "json":
        meta = {"routed_experts": encode_routed_experts(fresh), "routed_experts_dtype": "int32",
                "routed_experts_shape": list(fresh.shape)}
        return _respond(JSON_WIRE.dumps({"text": "a", "meta_info": meta}), JSON_WIRE)
    return _respond(MSGPACK_WIRE.dumps({"text": "a", "meta_info": {
        "routed_experts": fresh, "routed_experts_dtype": "int32",
        "routed_experts_shape": list(fresh.shape)}}), MSGPACK_WIRE)


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning",
            http=guarded_h11_protocol(30.0, 1000))
"""


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: _median_ms(v) for k, v in times.items()}


def zmq_hop(rows: np.ndarray, repeats: int) -> dict[str, float]:
    ctx = zmq.Context()
    path = os.path.join(tempfile.mkdtemp(), "hop.ipc")
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"ipc://{path}")
    push.connect(f"ipc://{path}")

    def hop(payload: dict) -> None:
        send_obj(push, payload)
        recv_obj(pull)

    try:
        return _interleaved({"off": lambda: hop({"rid": "x"}),
                             "rows": lambda: hop({"rid": "x", "rows": rows})}, repeats)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def http_leg(num_rows: int, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(num_rows), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=120) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    client.post(f"{url}/off")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            bodies: dict[str, bytes] = {}

            def fetch(kind: str) -> None:
                bodies[kind] = client.post(f"{url}/{kind}").content

            legs = _interleaved({k: (lambda k=k: fetch(k)) for k in ("off", "json", "msgpack")},
                                repeats)
            decodes = _interleaved({
                "json": lambda: extract_routed_experts_from_meta_info(orjson.loads(bodies["json"])),
                "msgpack": lambda: extract_routed_experts_from_meta_info(
                    msgpack.unpackb(bodies["msgpack"])),
            }, repeats)
            for kind in ("json", "msgpack"):
                load = orjson.loads if kind == "json" else msgpack.unpackb
                got = extract_routed_experts_from_meta_info(load(bodies[kind]))
                assert got.shape == (num_rows, LAYERS, TOP_K)
        return legs, decodes
    finally:
        server.terminate()
        server.wait(timeout=30)


def socket_floor(rows: np.ndarray, repeats: int) -> dict[str, float]:
    data = memoryview(rows).cast("B")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1)
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    into = memoryview(bytearray(len(data)))

    def read(prealloc: bool) -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"!")
            got, parts = 0, []
            while got < len(data):
                if prealloc:
                    got += s.recv_into(into[got:])
                else:
                    parts.append(s.recv(65536))
                    got += len(parts[-1])
            b"".join(parts)

    try:
        return _interleaved({"prealloc": lambda: read(True), "joined": lambda: read(False)},
                            repeats)
    finally:
        listener.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args(argv)
    print(f"`python {' '.join(sys.argv)}`\n")
    print("| rows | int32 MiB | zmq hop (added) | http json (added) | http msgpack (added) | "
          "client decode json | client decode msgpack | socket floor prealloc | "
          "socket floor 64 KiB reads |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        rows = np.random.default_rng(0).integers(0, 128, (n, LAYERS, TOP_K), dtype=np.int32)
        hop = zmq_hop(rows, args.repeats)
        legs, decodes = http_leg(n, args.repeats)
        floor = socket_floor(rows, args.repeats)
        print(f"| {n} | {rows.nbytes / 2**20:.0f} | {hop['rows'] - hop['off']:+.1f} | "
              f"{legs['json'] - legs['off']:+.1f} | {legs['msgpack'] - legs['off']:+.1f} | "
              f"{decodes['json']:.1f} | {decodes['msgpack']:.1f} | {floor['prealloc']:.1f} | "
              f"{floor['joined']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
