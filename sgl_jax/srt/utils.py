"""Small process-level helpers shared by the engine's processes."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from sgl_jax.srt.server_args import ServerArgs

T = TypeVar("T")


class EngineStartupError(RuntimeError):
    """A scheduler or detokenizer (process or thread) did not start: its report's traceback,
    its exit code or the time it was given. Raised by the engine's side of ``report_startup``."""


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{' ' + prefix if prefix else ''}] %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", force=True)


def report_startup(pipe: Any, build: Callable[[], T],
                   ready_info: Callable[[T], dict[str, Any]] = lambda _: {}) -> T:
    """``build()``, reporting over ``pipe`` (``send(dict)``) ``{"status": "ready", ...}`` or
    the error's traceback (then re-raised): what the engine waits for at start-up, from a
    child process or a thread of its own process alike."""
    try:
        built = build()
        pipe.send({"status": "ready", **ready_info(built)})
    except BaseException:
        pipe.send({"status": "error", "error": traceback.format_exc()})
        raise
    return built


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
