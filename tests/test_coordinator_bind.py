"""M26: node 0's JAX coordinator listens on the address of ``dist_init_addr`` only.

Node 0 of a 2-node job is started on 127.0.0.1 (no node 1: it waits for it); while it waits,
the kernel's table of listening TCP sockets shows the coordinator's port bound to 127.0.0.1,
not to every interface (0.0.0.0 or ::, JAX's default).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sgl_jax.testing import free_port

SCRIPT = """
import sys
from sgl_jax.srt.distributed import maybe_initialize_distributed
maybe_initialize_distributed(sys.argv[1], 2, 0)
"""


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    out.append(addr)
    return out


def test_coordinator_binds_the_given_address_only():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, f"127.0.0.1:{port}"],
                            env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        found: list[str] = []
        while time.monotonic() < deadline and not found and proc.poll() is None:
            found = listeners(port)
            time.sleep(0.2)
        print(f"coordinator on port {port} listens on {found}")
        assert found, "the coordinator never listened"
        # 127.0.0.1 (little-endian hex), as IPv4 or IPv4-mapped IPv6; not 0.0.0.0 nor ::.
        loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
        assert set(found) <= loopback, found
    finally:
        proc.kill()
        proc.wait(10)

