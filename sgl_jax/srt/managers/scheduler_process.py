"""The scheduler as a process or a thread: its start-up handshake (``start_scheduler``: build,
load, compile, report ready or the error) and its loop's life (``run_scheduler_process``: the
child process's entry, stopped by SIGTERM, a crash logged with the followers of a multi-node
job told)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from jax.sharding import Mesh

from sgl_jax.srt.managers.multi_node import exit_on_fatal
from sgl_jax.srt.managers.scheduler import Scheduler
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.utils import (
    configure_logging,
    enable_compilation_cache,
    report_startup,
    watch_parent,
)

logger = logging.getLogger(__name__)


def start_scheduler(server_args: ServerArgs, port_args: PortArgs, pipe: Any,
                    mesh: Mesh | None = None) -> Scheduler:
    """Builds the scheduler (loads and compiles) and reports ready with its numbers, or the
    error, over ``pipe``: the child process's and the single-process mode's start-up."""
    t0 = time.perf_counter()

    def ready_info(scheduler: Scheduler) -> dict[str, Any]:
        runner = scheduler.runner
        return {
            "pid": os.getpid(),
            "startup_seconds": time.perf_counter() - t0,
            "load_seconds": runner.load_seconds,
            "max_total_tokens": runner.max_total_tokens,
            "max_running_requests": runner.max_running_requests,
            "context_length": runner.context_len,
            "memory_bytes": runner.memory_report(),
            "num_compiles": runner.num_compiles,
        }

    return report_startup(pipe, lambda: Scheduler(server_args, port_args, mesh=mesh), ready_info)


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    configure_logging(server_args.log_level, prefix="scheduler")
    watch_parent()
    enable_compilation_cache(server_args)
    scheduler = start_scheduler(server_args, port_args, pipe)
    threading.current_thread().name = "scheduler"
    if server_args.nnodes > 1:
        # SIGTERM (Engine.shutdown) ends the loop, so the followers are told to stop.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        scheduler.event_loop()
    except SystemExit:
        logger.info("scheduler stopped")
    except BaseException:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        if server_args.nnodes > 1:
            # A step fails when a node is lost, and the step channel's watcher then names it
            # (exit_on_fatal) within a heartbeat or two: give it that long. Never fall through
            # to a normal exit: JAX's atexit hook shuts the distributed runtime down, which
            # waits for every node, and a lost node never answers.
            time.sleep(min(server_args.dist_timeout, 5.0))
            exit_on_fatal("the scheduler crashed (see above)")
        raise
    finally:
        scheduler.close()
