"""How should rank 0 send a step's host inputs to the other nodes: ZMQ or a JAX collective?

    python benchmarks/bench_step_broadcast.py [--repeats 200]

Starts two processes on loopback that form one JAX job (``jax.distributed``, 2 fake CPU
devices each, gloo collectives), as the multi-node tests do. For step inputs of a decode batch
of 1, 64 and 256 requests and of a 2048-token prefill (the pickled ``ModelWorkerBatch``
rank 0 publishes), it times, interleaved in one run:

- ``zmq``: rank 0 sends the pickled batch over a TCP DEALER/ROUTER pair, rank 1 unpickles it
  and answers one byte; one way = half the round trip.
- ``broadcast_one_to_all``: ``jax.experimental.multihost_utils.broadcast_one_to_all`` of the
  same bytes as a uint8 array (what a collective-based design would run per step), timed on
  rank 0 until its result is ready.

Prints medians in milliseconds and the ratio (docs/parallelism.md records them).

    python benchmarks/bench_step_broadcast.py --codec [--repeats 2000]

times, in this process only, what the channel's trust costs per message on each side
(docs/security.md): the pickle the channel used to send (``pickle.dumps`` on rank 0,
``pickle.loads`` on a follower) against its typed MessagePack codec with an HMAC-SHA256 tag
(``node_wire.encode`` + ``node_auth.seal``; ``node_auth.open_sealed`` + ``node_wire.decode``).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = {"decode bs 1": (1, 1), "decode bs 64": (64, 64), "decode bs 256": (256, 256),
         "prefill 2048 tok": (8, 2048)}


def step_payload(rows: int, tokens: int) -> bytes:
    """The pickle rank 0 published for a step of ``rows`` requests and ``tokens`` tokens (the
    channel's format until M16; the collective comparison keeps its sizes)."""
    return pickle.dumps(step_message(rows, tokens), protocol=pickle.HIGHEST_PROTOCOL)


def step_message(rows: int, tokens: int) -> list:
    """The message rank 0 publishes for a step of ``rows`` requests and ``tokens`` tokens."""
    from sgl_jax.srt.forward_batch_info import ForwardMode, ModelWorkerBatch
    from sgl_jax.srt.sampling.sampling_params import SamplingParams

    rng = np.random.default_rng(0)
    ints = lambda n: rng.integers(0, 1 << 20, n).astype(np.int32)  # noqa: E731
    mwb = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE if rows == tokens else ForwardMode.EXTEND,
        req_pool_indices=ints(rows), prefix_lens=ints(rows),
        extend_lens=np.full(rows, tokens // rows, np.int32), input_ids=ints(tokens),
        out_cache_loc=ints(tokens), sampling_params=[SamplingParams() for _ in range(rows)],
        seeds=list(range(rows)), steps=[0] * rows)
    return [1, "batch", (mwb, []), "0" * 32]


def codec_costs(repeats: int) -> None:
    """Medians per message of the old pickle and of the typed codec with its tag."""
    from sgl_jax.srt.managers import node_auth, node_wire

    secret, nonce = os.urandom(32), os.urandom(32)

    def median_us(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    print("| step inputs | pickle bytes | wire bytes (+32 tag) | pickle.dumps (us) | "
          "encode + seal (us) | pickle.loads (us) | open_sealed + decode (us) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, shape in SIZES.items():
        message = step_message(*shape)
        pickled = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        sealed = node_auth.seal(secret, node_auth.STEP, nonce, node_wire.encode(message))
        dumps = median_us(lambda m=message: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL))
        loads = median_us(lambda p=pickled: pickle.loads(p))
        enc = median_us(lambda m=message: node_auth.seal(
            secret, node_auth.STEP, nonce, node_wire.encode(m)))
        dec = median_us(lambda b=sealed: node_wire.decode(
            node_auth.open_sealed(secret, node_auth.STEP, nonce, b)))
        print(f"| {name} | {len(pickled):,} | {len(sealed):,} | {dumps:.0f} | {enc:.0f} | "
              f"{loads:.0f} | {dec:.0f} |")


def worker(rank: int, coordinator: str, channel_port: int, repeats: int) -> None:
    import jax
    import zmq
    from jax.experimental import multihost_utils

    jax.distributed.initialize(coordinator, num_processes=2, process_id=rank)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if rank == 0 else zmq.DEALER)
    if rank == 0:
        sock.bind(f"tcp://127.0.0.1:{channel_port}")
        peer, _ = sock.recv_multipart()
    else:
        sock.connect(f"tcp://127.0.0.1:{channel_port}")
        sock.send(b"hello")
    payloads = {name: step_payload(*shape) for name, shape in SIZES.items()}
    results: dict[str, dict[str, list[float]]] = {n: {"zmq": [], "collective": []}
                                                  for n in SIZES}
    for _ in range(repeats):
        for name, payload in payloads.items():
            # ZMQ round trip (rank 1 unpickles what it gets, as a follower does).
            t0 = time.perf_counter()
            if rank == 0:
                sock.send_multipart([peer, payload])
                sock.recv_multipart()
            else:
                pickle.loads(sock.recv())
                sock.send(b"k")
            results[name]["zmq"].append((time.perf_counter() - t0) / 2)
            # The collective alternative, same bytes.
            data = np.frombuffer(payload, np.uint8)
            t0 = time.perf_counter()
            out = multihost_utils.broadcast_one_to_all(data)
            np.asarray(out)
            results[name]["collective"].append(time.perf_counter() - t0)
    if rank == 0:
        print("| step inputs | bytes | zmq one way (ms) | broadcast_one_to_all (ms) | ratio |")
        print("|---|---:|---:|---:|---:|")
        for name, payload in payloads.items():
            z = statistics.median(results[name]["zmq"]) * 1e3
            c = statistics.median(results[name]["collective"]) * 1e3
            print(f"| {name} | {len(payload):,} | {z:.3f} | {c:.3f} | {c / z:.0f}x |")
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--codec", action="store_true",
                        help="time the channel's codec and tag against pickle, in-process")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--channel-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.codec:
        codec_costs(args.repeats)
        return
    if args.worker is not None:
        worker(args.worker, args.coordinator, args.channel_port, args.repeats)
        return
    from sgl_jax.testing import free_port_pair

    port = free_port_pair()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", str(rank), "--coordinator", f"127.0.0.1:{port}",
         "--channel-port", str(port + 1), "--repeats", str(args.repeats)], env=env)
        for rank in (0, 1)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
