"""M26 item 1: a flood of unauthenticated first frames at rank 0's step channel during
start-up (127.0.0.1 only, bounded: 100k frames from one process).

The flooder asks for the challenge 100k times and never reads the answers (a tiny receive
buffer, a receive high-water mark of 1). Rank 0 must never block on it: a real follower joins
while the flood goes on, and without a follower the start-up timeout fires with a clear error.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from sgl_jax.srt.managers.step_channel import (
    ASK,
    FollowerChannel,
    LeaderChannel,
    step_endpoint,
)
from sgl_jax.testing import free_port_pair

SECRET = b"s" * 32
FLOOD_FRAMES = 100_000


def _describe(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    return [] if ours == theirs else ["fingerprints differ"]


class Flooder:
    """A peer that speaks just enough ZMTP 3.0 (NULL mechanism, a DEALER) on a raw TCP socket
    to send ``FLOOD_FRAMES`` challenge requests, and never reads a byte of the answers (a
    receive buffer of a few KB): rank 0's replies pile up in its own buffers."""

    def __init__(self, addr: str) -> None:
        host, port = step_endpoint(addr)  # the channel's port, beside the coordinator's
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, port))
        name, value = b"Socket-Type", b"DEALER"
        ready = (b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value))
                 + value)
        # The greeting in its steps (libzmq answers each part before it reads the next),
        # reading rank 0's greeting as it comes; nothing is read after the handshake.
        self.sock.settimeout(10)
        for part in (b"\xff" + b"\0" * 8 + b"\x7f", bytes([3, 0]),
                     b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31,
                     bytes([0x04, len(ready)]) + ready):
            self.sock.sendall(part)
            time.sleep(0.05)
            if part[0] != 0x04:
                self.sock.recv(64)
        self.sent = 0
        self.thread = threading.Thread(target=self._flood, daemon=True)
        self.thread.start()

    def _flood(self) -> None:
        frame = bytes([0x00, len(ASK)]) + ASK  # one short, final frame
        batch = 1000
        self.sock.settimeout(30)  # bounded whatever happens
        try:
            while self.sent < FLOOD_FRAMES:
                self.sock.sendall(frame * batch)
                self.sent += batch
        except OSError:
            pass

    def stop(self) -> None:
        self.sock.close()
        self.thread.join(35)


def _leader_in_thread(addr: str, startup_timeout: float) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        t = time.monotonic()
        try:
            out["leader"] = LeaderChannel(addr, 2, {"k": "v"}, 10, startup_timeout,
                                          out.setdefault("fatal", []).append, _describe,
                                          SECRET)
        except Exception as e:  # noqa: BLE001 - what the test checks
            out["error"] = e
        out["seconds"] = time.monotonic() - t

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_follower_joins_during_a_flood():
    addr = f"127.0.0.1:{free_port_pair()}"
    thread, out = _leader_in_thread(addr, startup_timeout=30)
    time.sleep(0.3)
    flooder = Flooder(addr)
    follower = None
    try:
        flooder.thread.join(30)
        time.sleep(4.0)  # rank 0 has read most of the flood (and answered what it could)
        t = time.monotonic()
        follower_fatal: list[str] = []
        follower = FollowerChannel(addr, 1, {"k": "v"}, 10, 15, follower_fatal.append, SECRET)
        joined = time.monotonic() - t
        thread.join(20)
        print(f"flood of {flooder.sent} frames; follower joined in {joined:.2f}s")
        assert "leader" in out, out.get("error")
        out["leader"].publish("expert_recorder", "start")
        # Bounded: a channel that died (a side fell silent for its timeout while the flood
        # was read) is a failure that says why, not a test waiting forever.
        assert follower.io.main_end.poll(30_000), (follower_fatal, out.get("fatal"))
        assert follower.receive() == ("expert_recorder", "start", "")
        assert not follower_fatal and not out.get("fatal"), (follower_fatal, out.get("fatal"))
        out["leader"].close()
        assert follower.receive() is None  # goodbye: both ends stop their threads
        follower.io.thread.join(5)
    finally:
        flooder.stop()
        if follower is not None:
            follower.ctx.destroy(linger=0)
        if "leader" in out:
            out["leader"].ctx.destroy(linger=0)


def test_without_a_follower_the_start_up_timeout_fires_during_a_flood():
    addr = f"127.0.0.1:{free_port_pair()}"
    thread, out = _leader_in_thread(addr, startup_timeout=8)
    time.sleep(0.3)
    flooder = Flooder(addr)
    try:
        thread.join(20)
        print(f"flood of {flooder.sent} frames; start-up ended after "
              f"{out.get('seconds', float('nan')):.2f}s: {out.get('error')}")
        assert not thread.is_alive(), "rank 0 is wedged"
        assert isinstance(out.get("error"), TimeoutError)
        assert "did not join within 8 s" in str(out["error"])
        assert out["seconds"] < 8 + 2
    finally:
        flooder.stop()
