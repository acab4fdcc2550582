"""The step channel of a multi-node job: rank 0 sends every step's inputs to the followers.

One ZMQ TCP socket pair per job: rank 0 binds a ROUTER at ``--dist-init-addr``'s host and port
+ 1, every follower connects a DEALER. Why ZMQ and not a JAX collective: a step's inputs are a
few kilobytes of numpy that rank 0's scheduler already holds on the host; a TCP message gets
them to a follower in a fraction of a millisecond, while ``broadcast_one_to_all`` would be a
device computation of its own per step (measured in docs/parallelism.md). The step itself is
JAX's multi-controller SPMD: every node dispatches the same jitted program on its devices.

Trust (docs/security.md): nothing received is unpickled, and nothing is decoded before its
HMAC verified with the job's secret (``node_auth``); messages are ``node_wire``'s typed
MessagePack. Start-up: a follower asks rank 0 for its challenge (the job's random nonce), then
says hello with its rank, a fingerprint of its model and flags and a nonce of its own, tagged
with the secret; rank 0 answers welcome, or refused with what differs (tagged too, over the
follower's nonce, so the follower knows it is the real rank 0), and both fail at once on a
mismatch. A hello that does not verify, or anything else from a stranger, is refused and logged
and rank 0 goes on waiting for its followers. ZMQ names the followers' connections itself (the
followers set no identity), so no stranger can take a follower's name.

Every later message of rank 0 (the unpadded batch of a step with its prefix page rows and the
digest of its padded inputs, or a control operation) is numbered, tagged over its number and the job's nonce, and a
follower applies them in order only: a replayed, reordered, altered or foreign message stops
the follower (it cannot go on without the step it missed).

Then each side runs one I/O thread that alone owns its TCP socket (ZMQ sockets are not
thread-safe): it forwards messages between the socket and the main thread (over an ``inproc``
pair), sends a heartbeat every ``timeout / 4`` seconds, and calls ``on_fatal`` when a peer
disconnects (a process that dies closes its connections) or sends nothing for ``timeout``
seconds (a process that is stopped or cut off). Rank 0's thread hears only its followers'
heartbeats: frames of any other connection are dropped, and a stranger that connects and
disconnects does not stop the job (rank 0 tells which connection went by sending to each
follower). ``on_fatal`` does not return: the process exits, and a scheduler that exits makes
the server answer 503 and exit non-zero.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl_jax.srt.managers import node_auth, node_wire

logger = logging.getLogger(__name__)

# First frame of every message: what it is.
HEARTBEAT = b"hb"
GOODBYE = b"bye"
STEP = b"step"
ASK = b"challenge?"  # follower -> rank 0: send me the job's nonce
CHALLENGE = b"challenge"  # rank 0 -> follower: the job's nonce
HELLO = b"hello"  # follower -> rank 0: tagged (rank, fingerprint, the follower's nonce)
WELCOME = b"welcome"  # rank 0 -> follower: tagged (the follower's nonce, what differs)
REFUSED = b"refused"  # rank 0 -> a peer it cannot trust: why (untagged, plain text)
_MAX_REASON = 300  # characters of an untagged refusal shown


def step_endpoint(dist_init_addr: str) -> tuple[str, int]:
    """(host, port) of the step channel: the coordinator's host, its port + 1."""
    host, _, port = dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr={dist_init_addr!r} must be host:port")
    return host, int(port) + 1


CHALLENGE_BUDGET = 2  # challenges a connection gets without a hello (a follower needs one)
_MAX_DROPPED = 100_000  # connections remembered as ignored


def _send_now(sock: zmq.Socket, frames: list[Any]) -> bool:
    """Sends without waiting; False if the peer's queue is full or the peer is gone."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return True
    except zmq.ZMQError:  # EAGAIN: not reading; EHOSTUNREACH (ROUTER_MANDATORY): gone
        return False


class _StrangerLog:
    """Logs refused connections: the first ten, then one in a hundred (a stranger must not be
    able to flood the log)."""

    def __init__(self) -> None:
        self.count = 0

    def refused(self, frame: zmq.Frame | None, peer: bytes, reason: str) -> None:
        self.count += 1
        if self.count <= 10 or self.count % 100 == 0:
            address = "?"
            try:
                if frame is not None:
                    address = frame.get("Peer-Address")  # the peer's IP, from the TCP socket
            except (zmq.ZMQError, AttributeError):
                pass
            logger.warning("step channel: refused connection %s from %s (%d refused so far): "
                           "%s", peer.hex(), address, self.count, reason)


FRAMES_PER_TURN = 256  # frames _IoThread._receive takes before it sends again


class _IoThread:
    """Owns one TCP socket: relays between it and the main thread's inproc pair, heartbeats,
    and watches the peers."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, peers: dict[bytes, str],
                 timeout: float, on_fatal: Callable[[str], None], name: str) -> None:
        self.sock, self.names, self.timeout = sock, peers, timeout
        self.peers = list(peers)
        self.router = sock.type == zmq.ROUTER
        self.on_fatal = on_fatal
        self.strangers = _StrangerLog()
        addr = f"inproc://step-channel-{id(self)}"
        self.thread_end = ctx.socket(zmq.PAIR)
        self.thread_end.bind(addr)
        self.main_end = ctx.socket(zmq.PAIR)  # used by the main thread only
        self.main_end.connect(addr)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.last_seen = {peer: time.monotonic() for peer in self.peers}
        self.closing = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _send(self, frames: list[Any]) -> bool:
        """Sends to every peer; False (after ``on_fatal``) if one is gone."""
        for peer in self.peers:
            try:
                if self.router:
                    self.sock.send_multipart([peer, *frames], copy=False)
                else:
                    self.sock.send_multipart(frames, copy=False)
            except zmq.ZMQError as e:  # ROUTER_MANDATORY: a peer without a connection
                if not self.closing:
                    if e.errno == zmq.EHOSTUNREACH:
                        self.on_fatal(f"lost the connection to {self.names[peer]}")
                    else:
                        self.on_fatal(f"cannot reach {self.names[peer]}: {e}")
                return False
        return True

    def _who(self, peers: list[bytes] | None = None) -> str:
        return ", ".join(self.names[p] for p in (peers or self.peers))

    def _receive(self) -> None:
        """Takes what the socket holds, at most ``FRAMES_PER_TURN`` frames: heartbeats refresh
        their peer; on a follower, rank 0's other messages go to the main thread. Rank 0 hears
        only its followers' heartbeats. The bound keeps a stranger's flood from holding the
        loop: heartbeats and the main thread's messages go out between turns, so the
        followers never fall silent while rank 0 reads (and refuses) a flood."""
        for _ in range(FRAMES_PER_TURN):
            if not self.sock.poll(0):
                return
            frames = self.sock.recv_multipart(copy=False)
            if self.router:
                peer = frames[0].bytes
                if peer not in self.last_seen:
                    self.strangers.refused(frames[1] if len(frames) > 1 else None, peer,
                                           "not a follower of this job (they joined at start-up)")
                    continue
                self.last_seen[peer] = time.monotonic()  # any frame of a follower: it lives
                continue
            self.last_seen[b""] = time.monotonic()
            body = frames
            if body[0].bytes == HEARTBEAT:
                continue
            if body[0].bytes == GOODBYE:  # rank 0 stops: so do we (the main thread checks it)
                self.closing = True
            self.thread_end.send_multipart(body, copy=False)
            if self.closing:
                return

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
                self._receive()
                if self.closing:
                    return
            if self.monitor in ready:
                recv_monitor_message(self.monitor)
                if not self.closing:
                    if not self.router:
                        self.on_fatal(f"lost the connection to {self._who()}")
                        return
                    # The event does not say whose connection it was: a follower's if sending
                    # to it fails (now, or at the next heartbeat once ZMQ has dropped its
                    # route), else a stranger's, which does not concern the job.
                    if not self._send([HEARTBEAT]):
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
                 describe: Callable[[dict[str, str], dict[str, str]], list[str]],
                 secret: bytes) -> None:
        host, port = step_endpoint(dist_init_addr)
        self.secret = secret
        self.nonce = os.urandom(node_auth.NONCE_BYTES)  # this job's: fresh at every start
        self.ctx = zmq.Context(1)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        # A stranger cannot make rank 0 buffer much before the MAC check.
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.bind(f"tcp://{host}:{port}")
        logger.info("step channel on %s:%d: waiting for %d follower node(s)", host, port,
                    nnodes - 1)
        self.strangers = _StrangerLog()
        try:
            peers = self._welcome(sock, nnodes, fingerprint, startup_timeout, describe)
        except BaseException:
            sock.close(linger=2000)  # the refusal reaches the follower before we exit
            self.ctx.term()
            raise
        self.seq = 0
        self.io = _IoThread(self.ctx, sock, peers, timeout, on_fatal, "step-channel")

    def _refuse(self, sock: zmq.Socket, peer: bytes, frame: zmq.Frame | None,
                reason: str) -> None:
        """Logs a peer rank 0 does not trust and tells it why (it may be a misconfigured
        follower); decodes nothing of it."""
        self.strangers.refused(frame, peer, reason)
        try:
            sock.send_multipart([peer, REFUSED, reason.encode()], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # gone already, or not reading: nothing to tell

    def _welcome(self, sock: zmq.Socket, nnodes: int, fingerprint: dict[str, str],
                 startup_timeout: float,
                 describe: Callable[[dict[str, str], dict[str, str]], list[str]],
                 ) -> dict[bytes, str]:
        """Every follower's hello, verified and checked against ours: refuses (and goes on
        waiting) what does not verify; raises ValueError when a genuine follower differs."""
        deadline = time.monotonic() + startup_timeout
        peers: dict[int, bytes] = {}
        # Rank 0 never blocks on a peer before it is trusted: every send is non-blocking, a
        # connection gets CHALLENGE_BUDGET challenges without a hello, and a connection that
        # was refused, spent its budget or does not read its replies is ignored from then on.
        unanswered: dict[bytes, int] = {}
        dropped: set[bytes] = set()

        def drop(peer: bytes, frame: zmq.Frame | None, reason: str) -> None:
            if len(dropped) >= _MAX_DROPPED:  # a bound on memory; sends stay non-blocking
                dropped.clear()
            dropped.add(peer)
            unanswered.pop(peer, None)
            self._refuse(sock, peer, frame, reason)

        while len(peers) < nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(timeout=max(1, int(left * 1000))):
                missing = sorted(set(range(1, nnodes)) - set(peers))
                flood = (f"; {self.strangers.count} connection(s) were refused or dropped "
                         "meanwhile (a stranger flooding the channel, or nodes with another "
                         "secret: the log's 'refused connection' lines say from where)"
                         if self.strangers.count else "")
                raise TimeoutError(
                    f"follower node(s) {missing} did not join within {startup_timeout:g} s: "
                    "start the same command on every host with --node-rank set (and the same "
                    f"node secret){flood}")
            frames = sock.recv_multipart(copy=False)
            peer, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            first = frames[1] if len(frames) > 1 else None
            if peer in peers.values() or peer in dropped:  # heartbeats; ignored strangers
                continue
            if body == [ASK]:
                asked = unanswered.get(peer, 0)
                if asked >= CHALLENGE_BUDGET:
                    drop(peer, first, f"asked for the challenge {asked + 1} times without "
                                      "a hello")
                elif not _send_now(sock, [peer, CHALLENGE, self.nonce]):
                    drop(peer, first, "does not read its replies")
                else:
                    unanswered[peer] = asked + 1
                continue
            if len(body) != 2 or body[0] != HELLO:
                drop(peer, first, "not a node of this job's step channel (sent something "
                                  "other than a hello)")
                continue
            unanswered.pop(peer, None)
            try:  # the tag first: nothing of a stranger is decoded
                raw = node_auth.open_sealed(self.secret, node_auth.HELLO, self.nonce, body[1])
            except ValueError:
                drop(peer, first, "its hello does not verify with this job's "
                             "node secret (a stranger, a node given another secret, or a "
                             "hello of another job)")
                continue
            try:
                rank, theirs, their_nonce = _parse_hello(node_wire.decode(raw))
            except ValueError as e:
                drop(peer, first, f"its hello is malformed: {e}")
                continue
            errors = describe(fingerprint, theirs)
            if rank in peers or not 0 < rank < nnodes:
                errors = [f"node rank {rank} is taken or out of range [1, {nnodes})"]
            answer = node_wire.encode({"nonce": their_nonce, "errors": errors})
            welcomed = _send_now(sock, [peer, WELCOME, node_auth.seal(
                self.secret, node_auth.WELCOME, self.nonce, answer)])
            if errors:
                raise ValueError(f"node {rank} differs from node 0: " + "; ".join(errors))
            if not welcomed:  # a hello that verifies, from a peer that does not read
                drop(peer, first, "does not read its replies")
                continue
            peers[rank] = peer
            logger.info("follower node %d joined", rank)
        return {peers[r]: f"node {r}" for r in sorted(peers)}

    def publish(self, op: str, payload: Any, digest: str = "") -> None:
        """Sends message ``seq`` to every follower (they apply messages in order)."""
        self.seq += 1
        self.io.main_end.send_multipart([STEP, self._seal(op, payload, digest)], copy=False)

    def _seal(self, op: str, payload: Any, digest: str) -> bytes:
        body = node_wire.encode([self.seq, op, payload, digest])
        return node_auth.seal(self.secret, node_auth.STEP, self.nonce, body)

    def close(self) -> None:
        """Tells the followers to stop (they exit 0)."""
        self.io.closing = True
        self.seq += 1
        self.io.main_end.send_multipart([GOODBYE, self._seal("goodbye", None, "")])
        self.io.thread.join(timeout=2)


def _parse_hello(hello: Any) -> tuple[int, dict[str, str], bytes]:
    if not (isinstance(hello, dict) and set(hello) == {"rank", "fingerprint", "nonce"}
            and isinstance(hello["rank"], int) and isinstance(hello["fingerprint"], dict)
            and all(isinstance(k, str) and isinstance(v, str)
                    for k, v in hello["fingerprint"].items())
            and isinstance(hello["nonce"], bytes)
            and len(hello["nonce"]) == node_auth.NONCE_BYTES):
        raise ValueError("expected rank, fingerprint and nonce")
    return hello["rank"], hello["fingerprint"], hello["nonce"]


class FollowerChannel:
    """A follower's end: hello at start-up, then the numbered messages of rank 0."""

    def __init__(self, dist_init_addr: str, rank: int, fingerprint: dict[str, str],
                 timeout: float, startup_timeout: float,
                 on_fatal: Callable[[str], None], secret: bytes) -> None:
        host, port = step_endpoint(dist_init_addr)
        self.secret = secret
        self.ctx = zmq.Context(1)
        sock = self.ctx.socket(zmq.DEALER)  # no identity: rank 0's ROUTER names us
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")  # retried until rank 0 binds
        try:
            self.nonce = self._hello(sock, rank, fingerprint, startup_timeout, host, port)
        except BaseException:
            sock.close()
            self.ctx.term()
            raise
        self.expected = 1
        self.io = _IoThread(self.ctx, sock, {b"": "rank 0"}, timeout, on_fatal,
                            "step-channel")

    def _hello(self, sock: zmq.Socket, rank: int, fingerprint: dict[str, str],
               startup_timeout: float, host: str, port: int) -> bytes:
        """Challenge, hello, welcome; the job's nonce. Raises ValueError if rank 0 refuses
        us or does not prove it holds the secret, TimeoutError if it does not answer."""
        deadline = time.monotonic() + startup_timeout

        def answer(expected: bytes) -> list[bytes]:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(timeout=max(1, int(left * 1000))):
                raise TimeoutError(f"rank 0 did not answer at {host}:{port} within "
                                   f"{startup_timeout:g} s (is node 0 started with the same "
                                   "--dist-init-addr?)")
            frames = sock.recv_multipart()
            if frames[0] == REFUSED and len(frames) == 2:
                reason = frames[1].decode("utf-8", "replace")[:_MAX_REASON]
                raise ValueError(f"node 0 refused this node: {reason!r}")
            if frames[0] != expected or len(frames) != 2:
                raise ValueError(f"{host}:{port} answered something other than node 0's step "
                                 f"channel would ({frames[0][:20]!r})")
            return frames

        sock.send(ASK)
        job_nonce = answer(CHALLENGE)[1]
        if len(job_nonce) != node_auth.NONCE_BYTES:
            raise ValueError(f"{host}:{port} sent a malformed challenge")
        mine = os.urandom(node_auth.NONCE_BYTES)
        hello = node_wire.encode({"rank": rank, "fingerprint": fingerprint, "nonce": mine})
        sock.send_multipart([HELLO, node_auth.seal(self.secret, node_auth.HELLO, job_nonce,
                                                   hello)])
        sealed = answer(WELCOME)[1]
        try:
            reply = node_wire.decode(node_auth.open_sealed(
                self.secret, node_auth.WELCOME, job_nonce, sealed))
        except ValueError as e:
            raise ValueError(f"node 0's answer at {host}:{port} does not verify with this "
                             f"node's secret ({e}); every node needs the same one: "
                             + node_auth.how_to_give()) from e
        if not (isinstance(reply, dict) and reply.get("nonce") == mine
                and isinstance(reply.get("errors"), list)):
            raise ValueError(f"node 0's answer at {host}:{port} is not the answer to this "
                             "node's hello")
        if reply["errors"]:
            raise ValueError("this node differs from node 0: "
                             + "; ".join(map(str, reply["errors"])))
        return job_nonce

    def receive(self) -> tuple[str, Any, str] | None:
        """The next message (op, payload, digest), None once rank 0 says goodbye. Raises
        ValueError on a message that does not verify or decode (nothing of it is used) and
        RuntimeError on one out of order (a replay, or a lost message)."""
        frames = self.io.main_end.recv_multipart()
        if len(frames) != 2 or frames[0] not in (STEP, GOODBYE):
            raise ValueError(f"unexpected message kind {frames[0][:20]!r} from rank 0")
        body = node_auth.open_sealed(self.secret, node_auth.STEP, self.nonce, frames[1])
        message = node_wire.decode(body)
        if not (isinstance(message, list) and len(message) == 4
                and isinstance(message[0], int) and isinstance(message[1], str)
                and isinstance(message[3], str)):
            raise ValueError("malformed message from rank 0: expected (seq, op, payload, "
                             "digest)")
        seq, op, payload, digest = message
        if seq != self.expected:
            raise RuntimeError(f"got message {seq} from rank 0, expected {self.expected}")
        self.expected += 1
        if (op == "goodbye") != (frames[0] == GOODBYE):
            raise ValueError(f"message {seq} from rank 0 is {op!r} under {frames[0]!r}")
        if op == "goodbye":
            return None
        return op, payload, digest
