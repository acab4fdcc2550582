"""Single-process mode (``enable_single_process``): the scheduler and the detokenizer as
threads of the caller's process.

They are the very objects the child processes run (``start_scheduler`` /
``DetokenizerManager``), exchanging the same messages over the same ``ipc://`` sockets in the
engine's private directory: each component keeps its own ZMQ context and sockets, created and
closed in the thread that uses them, so nothing but the start-up differs from the multi-process
path. (``inproc://`` would need one shared context for all three components, a second way to
wire them for no measurable gain: the messages are small and the routed-experts rows travel out
of band either way.) The model is built on the caller's JAX runtime, on the caller's mesh if it
gives one, so its arrays live in the caller's process.

``WorkerThreads`` offers what the Engine uses of ``Subprocesses``: the start-up ``info``,
``watch`` (a thread that fails calls ``on_death``, as a child that dies does), ``pids`` (none:
there is no child process) and ``stop``.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from sgl_jax.srt.bounded_text import bound_message
from sgl_jax.srt.managers.detokenizer_manager import DetokenizerManager
from sgl_jax.srt.managers.scheduler_process import start_scheduler
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.utils import EngineStartupError, enable_compilation_cache, report_startup

logger = logging.getLogger(__name__)

# A step in flight (at worst a compilation of a shape outside the buckets) ends before its
# thread sees the stop event; beyond this, stop() gives up waiting and says so.
JOIN_TIMEOUT = 60.0


class _StatusQueue:
    """The start-up report channel: what a child's status pipe is to a process."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def send(self, msg: dict[str, Any]) -> None:
        self._queue.put(msg)

    def recv(self, timeout: float) -> dict[str, Any]:
        return self._queue.get(timeout=timeout)


class WorkerThreads:
    """The scheduler and detokenizer threads, their start-up handshake and their failure."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs,
                 mesh: Mesh | None = None) -> None:
        self.port_args = port_args
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._on_death: Callable[[str], None] | None = None
        self._death: str | None = None
        # The caller's JAX settings win: a trainer that set its own cache keeps it.
        if jax.config.jax_compilation_cache_dir is None:
            enable_compilation_cache(server_args)
        starts: dict[str, Callable[[_StatusQueue], Any]] = {
            "scheduler": lambda status: start_scheduler(server_args, port_args, status, mesh),
            "detokenizer": lambda status: report_startup(
                status, lambda: DetokenizerManager(server_args, port_args)),
        }
        self.threads: dict[str, threading.Thread] = {}
        statuses: dict[str, _StatusQueue] = {}
        for name, start in starts.items():
            statuses[name] = _StatusQueue()
            self.threads[name] = threading.Thread(
                target=self._run, args=(name, start, statuses[name]),
                name=f"sgl-jax-{name}", daemon=True)  # daemon: see Engine's atexit shutdown
            self.threads[name].start()
        self.info = {name: self._handshake(name, status, server_args.startup_timeout)
                     for name, status in statuses.items()}

    def _run(self, name: str, start: Callable[[_StatusQueue], Any],
             status: _StatusQueue) -> None:
        try:
            worker = start(status)
        except BaseException:  # noqa: BLE001 - reported over ``status``, raised by the handshake
            return
        try:
            worker.event_loop(self._stop)
        except BaseException as e:  # noqa: BLE001 - the caller hears of it through on_death
            logger.error("the %s thread failed:\n%s", name, traceback.format_exc())
            self._died(f"the {name} thread failed ({type(e).__name__}: "
                       f"{bound_message(str(e))}); the engine cannot serve requests any more")
        finally:
            worker.close()

    def _handshake(self, name: str, status: _StatusQueue, timeout: float) -> dict[str, Any]:
        """``name``'s start-up report; on a failure, stops every thread and raises."""
        try:
            msg = status.recv(timeout)
        except queue.Empty:
            msg = {"error": f"not ready within {timeout:.0f}s"}
        except BaseException:  # interrupted (Ctrl-C): nothing is left running
            self.stop()
            raise
        if msg.get("status") == "ready":
            return msg
        self.stop()
        raise EngineStartupError(f"the {name} thread failed to start:\n{msg.get('error')}")

    def _died(self, reason: str) -> None:
        with self._lock:
            if self._death is not None or self._stop.is_set():
                return  # the first failure is the one to report; none once stopping
            self._death = reason
            on_death = self._on_death
        if on_death is not None:
            on_death(reason)

    def watch(self, on_death: Callable[[str], None]) -> None:
        """``on_death(reason)`` once a thread fails (at once if one failed already)."""
        with self._lock:
            self._on_death = on_death
            death = self._death
        if death is not None:
            on_death(death)

    def pids(self) -> dict[str, int]:
        return {}  # no child process

    def stop(self) -> None:
        """Ends both loops and waits for their threads (sockets closed, model released)."""
        self._stop.set()
        for name, thread in self.threads.items():
            if thread is threading.current_thread():
                continue
            thread.join(JOIN_TIMEOUT)
            if thread.is_alive():
                logger.error("the %s thread did not stop within %.0fs", name, JOIN_TIMEOUT)
        self.port_args.remove()
