"""The step channel of a multi-node job: rank 0 sends every step's inputs to the followers.

One ZMQ TCP socket pair per job: rank 0 binds a ROUTER at ``--dist-init-addr``'s host and port
+ 1, every follower connects a DEALER. Why ZMQ and not a JAX collective: a step's inputs are a
few kilobytes of numpy that rank 0's scheduler already holds on the host; a TCP message gets
them to a follower in a fraction of a millisecond, while ``broadcast_one_to_all`` would be a
device computation of its own per step (measured in docs/parallelism.md). The step itself is
JAX's multi-controller SPMD: every node dispatches the same jitted program on its devices.

Start-up: each follower says hello with its rank and a fingerprint of its model and flags;
rank 0 answers welcome, or refused with what differs, and both fail at once on a mismatch.

Then each side runs one I/O thread that alone owns its TCP socket (ZMQ sockets are not
thread-safe): it forwards messages between the socket and the main thread (over an ``inproc``
pair), sends a heartbeat every ``timeout / 4`` seconds, and calls ``on_fatal`` when the peer
disconnects (a process that dies closes its connections) or sends nothing for ``timeout``
seconds (a process that is stopped or cut off). ``on_fatal`` does not return: the process
exits, and a scheduler that exits makes the server answer 503 and exit non-zero.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

HEARTBEAT = b"hb"
GOODBYE = b"bye"
STEP = b"step"


def step_endpoint(dist_init_addr: str) -> tuple[str, int]:
    """(host, port) of the step channel: the coordinator's host, its port + 1."""
    host, _, port = dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr={dist_init_addr!r} must be host:port")
    return host, int(port) + 1


class _IoThread:
    """Owns one TCP socket: relays between it and the main thread's inproc pair, heartbeats,
    and watches the peers."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, peers: list[bytes], timeout: float,
                 on_fatal: Callable[[str], None], name: str) -> None:
        self.sock, self.peers, self.timeout = sock, peers, timeout
        self.on_fatal = on_fatal
        addr = f"inproc://step-channel-{id(self)}"
        self.thread_end = ctx.socket(zmq.PAIR)
        self.thread_end.bind(addr)
        self.main_end = ctx.socket(zmq.PAIR)  # used by the main thread only
        self.main_end.connect(addr)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.last_seen = {peer: time.monotonic() for peer in peers}
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _send(self, frames: list[Any]) -> bool:
        """Sends to every peer; False (after ``on_fatal``) if one is gone."""
        try:
            if self.sock.socket_type == zmq.ROUTER:
                for peer in self.peers:
                    self.sock.send_multipart([peer, *frames], copy=False)
            else:
                self.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: a peer without a connection
            if not self.closing:
                self.on_fatal(f"cannot reach {self._who()}: {e}")
            return False
        return True

    def _who(self, peers: list[bytes] | None = None) -> str:
        return ", ".join(p.decode() or "rank 0" for p in (peers or self.peers))

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in (self.thread_end, self.sock, self.monitor):
            poller.register(s, zmq.POLLIN)
        interval = self.timeout / 4
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                if not self._send([HEARTBEAT]):
                    return
                next_beat = now + interval
            ready = dict(poller.poll(timeout=max(1, int((next_beat - now) * 1000))))
            if self.thread_end in ready:
                frames = self.thread_end.recv_multipart(copy=False)
                if not self._send(frames) or frames[0].bytes == GOODBYE:
                    return
            if self.sock in ready:
                while self.sock.poll(0):
                    frames = self.sock.recv_multipart(copy=False)
                    router = self.sock.socket_type == zmq.ROUTER
                    peer, body = (frames[0].bytes, frames[1:]) if router else (b"", frames)
                    self.last_seen[peer] = time.monotonic()
                    if body[0].bytes == HEARTBEAT:
                        continue
                    if body[0].bytes == GOODBYE:  # rank 0 stops: so do we, cleanly
                        self.closing = True
                    self.thread_end.send_multipart(body, copy=False)
                    if self.closing:
                        return
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                if not self.closing:  # the event does not say which peer: name them all
                    who = self._who() if len(self.peers) == 1 else f"one of {self._who()}"
                    self.on_fatal(f"lost the connection to {who}")
                    return
            silent = [p for p, t in self.last_seen.items()
                      if time.monotonic() - t > self.timeout]
            if silent and not self.closing:
                self.on_fatal(f"{self._who(silent)} sent nothing for {self.timeout:g} s "
                              "(--dist-timeout): stopped or cut off")
                return


class LeaderChannel:
    """Rank 0's end: waits for every follower, then publishes numbered messages to all."""

    def __init__(self, dist_init_addr: str, nnodes: int, fingerprint: dict[str, str],
                 timeout: float, startup_timeout: float, on_fatal: Callable[[str], None],
                 describe: Callable[[dict[str, str], dict[str, str]], list[str]]) -> None:
        host, port = step_endpoint(dist_init_addr)
        self.ctx = zmq.Context(1)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.bind(f"tcp://{host}:{port}")
        logger.info("step channel on %s:%d: waiting for %d follower node(s)", host, port,
                    nnodes - 1)
        try:
            peers = self._welcome(sock, nnodes, fingerprint, startup_timeout, describe)
        except BaseException:
            sock.close(linger=2000)  # the refusal reaches the follower before we exit
            self.ctx.term()
            raise
        self.seq = 0
        self.io = _IoThread(self.ctx, sock, peers, timeout, on_fatal, "step-channel")

    @staticmethod
    def _welcome(sock: zmq.Socket, nnodes: int, fingerprint: dict[str, str],
                 startup_timeout: float,
                 describe: Callable[[dict[str, str], dict[str, str]], list[str]]) -> list[bytes]:
        """Every follower's hello, checked against ours; raises ValueError on a mismatch."""
        deadline = time.monotonic() + startup_timeout
        peers: dict[int, bytes] = {}
        while len(peers) < nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(timeout=int(left * 1000)):
                missing = sorted(set(range(1, nnodes)) - set(peers))
                raise TimeoutError(
                    f"follower node(s) {missing} did not join within {startup_timeout:g} s: "
                    "start the same command on every host with --node-rank set")
            peer, payload = sock.recv_multipart()
            rank, theirs = pickle.loads(payload)
            errors = describe(fingerprint, theirs)
            if rank in peers or not 0 < rank < nnodes:
                errors = [f"node rank {rank} is taken or out of range [1, {nnodes})"]
            sock.send_multipart([peer, pickle.dumps(errors)])
            if errors:
                raise ValueError(f"node {rank} differs from node 0: " + "; ".join(errors))
            peers[rank] = peer
            logger.info("follower node %d joined", rank)
        return [peers[r] for r in sorted(peers)]

    def publish(self, op: str, payload: Any, digest: str = "") -> None:
        """Sends message ``seq`` to every follower (they apply messages in order)."""
        self.seq += 1
        body = pickle.dumps((self.seq, op, payload, digest), protocol=pickle.HIGHEST_PROTOCOL)
        self.io.main_end.send_multipart([STEP, body], copy=False)

    def close(self) -> None:
        """Tells the followers to stop (they exit 0)."""
        self.io.closing = True
        self.io.main_end.send_multipart([GOODBYE])
        self.io.thread.join(timeout=2)


class FollowerChannel:
    """A follower's end: hello at start-up, then the numbered messages of rank 0."""

    def __init__(self, dist_init_addr: str, rank: int, fingerprint: dict[str, str],
                 timeout: float, startup_timeout: float,
                 on_fatal: Callable[[str], None]) -> None:
        host, port = step_endpoint(dist_init_addr)
        self.ctx = zmq.Context(1)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"node {rank}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")  # retried until rank 0 binds
        sock.send(pickle.dumps((rank, fingerprint)))
        if not sock.poll(timeout=int(startup_timeout * 1000)):
            raise TimeoutError(f"rank 0 did not answer at {host}:{port} within "
                               f"{startup_timeout:g} s (is node 0 started with the same "
                               "--dist-init-addr?)")
        errors = pickle.loads(sock.recv())
        if errors:
            raise ValueError("this node differs from node 0: " + "; ".join(errors))
        self.expected = 1
        self.io = _IoThread(self.ctx, sock, [b""], timeout, on_fatal, "step-channel")

    def receive(self) -> tuple[str, Any, str] | None:
        """The next message (op, payload, digest), None once rank 0 says goodbye. Raises
        RuntimeError on a message out of order."""
        frames = self.io.main_end.recv_multipart()
        if frames[0] == GOODBYE:
            return None
        seq, op, payload, digest = pickle.loads(frames[1])
        if seq != self.expected:
            raise RuntimeError(f"got message {seq} from rank 0, expected {self.expected}")
        self.expected += 1
        return op, payload, digest
