"""The cost of the output messages between processes: scheduler -> detokenizer -> manager.

Each step packs the outputs of ``--batch`` streaming requests (one new token each) with the
real ``OutputSender``, sends them over a real ``ipc://`` ZMQ socket with ``transport``,
receives them in a real ``DetokenizerManager`` (incremental detokenization included), which
sends its message on to a socket read as the tokenizer manager does, and hands what it read to
a real ``TokenizerManager``'s dispatch. Timed per step, in microseconds (median over
``--steps``):

- ``pack+send``: the scheduler's side (build the message, serialize, hand to ZMQ);
- ``detok``: receive, detokenize, serialize and send (the detokenizer process's work);
- ``recv``: the manager's receive and deserialization;
- ``total``: the three, and ``pickle B``: bytes of the scheduler's message without its
  out-of-band arrays;
- ``dispatch``: the manager's dispatch of what it received to the waiting requests (each
  piece's ``meta_info``, routed experts base64-encoded; for one-record-per-request messages,
  building the records of what it received), not in ``total``.

Workloads: ``plain`` (ids only), ``logprobs`` (top-5 per token), ``routed`` (each request's
newly completed routed-experts row, ``[layers, k]`` int32, streamed), ``burst`` (``--burst``
finishing requests with ``--burst-rows`` rows each, out of band, bounded messages).

Only public constructors shared by every revision since M9 are used, so
``bench_ab_commits.py`` can run it against an older tree:

    python benchmarks/bench_output_messages.py [--batch 64] [--steps 400]
    python benchmarks/bench_ab_commits.py --base main --rounds 3 -- \\
        benchmarks/bench_output_messages.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import sys
import time
from collections.abc import Callable

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(__file__))

from bench_utils import markdown_table, median  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager  # noqa: E402
from sgl_jax.srt.managers.output_sender import OutputSender  # noqa: E402
from sgl_jax.srt.managers.request_options import RequestOptions  # noqa: E402
from sgl_jax.srt.managers.schedule_batch import Req  # noqa: E402
from sgl_jax.srt.managers.tokenizer_manager import ReqState, TokenizerManager  # noqa: E402
from sgl_jax.srt.managers.transport import recv_obj, send_obj  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import PortArgs, ServerArgs  # noqa: E402

LAYERS, TOP_K, TOP_LOGPROBS = 48, 8, 5


class Pipeline:
    """The three ends of the two output sockets, in this process, and a tokenizer manager
    (on sockets of its own, idle) whose dispatch is handed what the last socket received."""

    def __init__(self) -> None:
        self.port_args = PortArgs.new()
        self.detok = DetokenizerManager(ServerArgs(), self.port_args)
        self.ctx = zmq.Context()
        self.to_detok = self.ctx.socket(zmq.PUSH)
        self.to_detok.connect(self.port_args.detokenizer_ipc)
        self.manager = self.ctx.socket(zmq.PULL)
        self.manager.bind(self.port_args.tokenizer_ipc)
        self.tm_port_args = PortArgs.new()
        self.tm = TokenizerManager(ServerArgs(), self.tm_port_args, ModelConfig.from_hf())
        self.loop = asyncio.new_event_loop()  # the waiting requests' (run between steps)

    def track(self, reqs: list[Req]) -> None:
        """A waiting request in the tokenizer manager for each of ``reqs`` (keyed by rid)."""
        for r in reqs:
            if r.rid not in self.tm._by_key:
                self.tm._by_key[r.rid] = ReqState(rid=r.rid, key=r.rid, loop=self.loop,
                                                  event=asyncio.Event(), options=r.options)

    def step(self, sender: OutputSender, reqs: list[Req]) -> tuple[float, ...]:
        """One step's messages through both hops; every request of ``reqs`` is due."""
        t0 = time.perf_counter()
        sender.send(reqs)
        t1 = time.perf_counter()
        left = len(reqs)
        while left:
            msg = recv_obj(self.detok.recv_socket)
            left -= _num_requests(msg)
            send_obj(self.detok.send_socket, self.detok.handle_batch_token_id_out(msg))
        t2 = time.perf_counter()
        left = len(reqs)
        received = []
        while left:
            received.append(recv_obj(self.manager))
            left -= _num_requests(received[-1])
        t3 = time.perf_counter()
        for msg in received:
            self.tm._dispatch(msg)
        t4 = time.perf_counter()
        for r in reqs:  # what the requests' coroutines would take
            self.tm._by_key[r.rid].pending.clear()
        self.loop.run_until_complete(asyncio.sleep(0))
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    def close(self) -> None:
        for sock in (self.to_detok, self.manager, self.detok.recv_socket,
                     self.detok.send_socket):
            sock.close(linger=0)
        self.tm.close()
        self.loop.close()
        self.port_args.remove()
        self.tm_port_args.remove()


def _num_requests(msg: object) -> int:
    """Requests in an output message, of either shape (parallel lists or one record each),
    without building its records where it can (that is the dispatch's work)."""
    rids = getattr(msg, "rids", None)
    if rids is not None:
        return len(rids)
    try:
        return len(msg)
    except TypeError:  # a batch without a length: its records were built when received
        return len(msg.outputs)


def _req(rid: str, options: RequestOptions, stream: bool = True) -> Req:
    return Req(rid=rid, origin_input_ids=list(range(1, 33)),
               sampling_params=SamplingParams(max_new_tokens=1 << 20), seed=0, stream=stream,
               options=options)


def _grow(reqs: list[Req], rng: np.random.Generator) -> None:
    """One new output token per request (and its logprob entry when it asked)."""
    for r in reqs:
        token = int(rng.integers(100, 2000))
        r.output_ids.append(token)
        if r.logprobs is not None:
            top = rng.random(TOP_LOGPROBS).astype(np.float32)
            r.logprobs.add("output", -0.5, token, top, np.arange(TOP_LOGPROBS), np.zeros(0))


def _workloads(batch: int, burst: int, burst_rows: int) -> dict[str, Callable]:
    row = np.random.default_rng(0).integers(0, 128, (1, LAYERS, TOP_K)).astype(np.int32)

    def rows_of(req: Req, start: int, weights: bool = False, raw: bool = False) -> np.ndarray:
        return row

    def streaming(options: RequestOptions) -> Callable:
        def make(sock: zmq.Socket) -> tuple[OutputSender, list[Req], bool]:
            reqs = [_req(f"r{i}", options) for i in range(batch)]
            return OutputSender(sock, 1, routed_rows_of=rows_of), reqs, True
        return make

    def bursting(sock: zmq.Socket) -> tuple[OutputSender, list[Req], bool]:
        rng = np.random.default_rng(1)
        reqs = []
        for i in range(burst):
            r = _req(f"b{i}", RequestOptions(return_routed_experts=True), stream=False)
            r.output_ids = [5]
            r.finished_reason = {"type": "length", "length": 1}
            r.routed_experts = rng.integers(0, 128, (burst_rows, LAYERS, TOP_K)).astype(np.int32)
            reqs.append(r)
        return OutputSender(sock, 1, routed_rows_of=rows_of), reqs, False

    return {
        f"plain bs{batch}": streaming(RequestOptions()),
        f"logprobs bs{batch}": streaming(RequestOptions(return_logprob=True,
                                                        top_logprobs_num=TOP_LOGPROBS)),
        f"routed bs{batch}": streaming(RequestOptions(return_routed_experts=True)),
        f"burst {burst}x{burst_rows}": bursting,
    }


def _pickle_bytes(sender: OutputSender, reqs: list[Req]) -> int:
    sent = [(r.sent_len, r.routed_sent) for r in reqs]
    msg = sender.pack(reqs)
    for r, (sent_len, routed_sent) in zip(reqs, sent, strict=True):
        r.sent_len, r.routed_sent = sent_len, routed_sent
    return len(pickle.dumps(msg, protocol=5, buffer_callback=lambda b: None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--burst-rows", type=int, default=4096)
    args = p.parse_args()
    pipe = Pipeline()
    rng = np.random.default_rng(0)
    rows = []
    try:
        for name, make in _workloads(args.batch, args.burst, args.burst_rows).items():
            sender, reqs, streaming = make(pipe.to_detok)
            times: list[tuple[float, ...]] = []
            size = 0
            for i in range(args.steps if streaming else max(args.steps // 20, 5)):
                if streaming:
                    _grow(reqs, rng)
                else:
                    for r in reqs:  # every step the same finishing burst
                        r.sent_len, r.routed_sent, r.rid = 0, 0, f"{r.rid.split('#')[0]}#{i}"
                if i == 0:
                    size = _pickle_bytes(sender, reqs)
                pipe.track(reqs)
                times.append(pipe.step(sender, reqs))
            us = [median([t[j] for t in times]) * 1e6 for j in range(4)]
            rows.append([name, *us[:3], median([sum(t[:3]) for t in times]) * 1e6, size, us[3]])
    finally:
        pipe.close()
    print(markdown_table(["workload", "pack+send us", "detok us", "recv us", "total us",
                          "pickle B", "dispatch us"], rows))


if __name__ == "__main__":
    main()
