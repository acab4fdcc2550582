"""Small process-level helpers shared by the engine's processes."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from sgl_jax.srt.server_args import ServerArgs


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{' ' + prefix if prefix else ''}] %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", force=True)


def enable_compilation_cache(server_args: ServerArgs) -> None:
    """Persist compiled programs so a second start of the same configuration is fast."""
    import jax

    path = server_args.compilation_cache_dir
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def watch_parent(poll_seconds: float = 1.0) -> None:
    """Exit this child process when its parent dies, so no orphan outlives the engine."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
