"""Entry point of the engine's child processes: ``python -m ... ROLE STATUS_FD``.

Children are fresh interpreters rather than multiprocessing children, so a user's script
without an ``if __name__ == "__main__"`` guard is never re-imported (and re-run) by them.
The parent writes the pickled (ServerArgs, PortArgs) to stdin; the child reports its start-up
status as a pickled dict over the inherited file descriptor STATUS_FD.
"""

from __future__ import annotations

import pickle
import signal
import sys
from multiprocessing.connection import Connection


def main() -> None:
    # Ctrl-C reaches the whole process group; the parent decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role, status_fd = sys.argv[1], int(sys.argv[2])
    server_args, port_args = pickle.load(sys.stdin.buffer)
    status = Connection(status_fd, readable=False)
    if role == "scheduler":
        from sgl_jax.srt.managers.scheduler_process import run_scheduler_process as run
    elif role == "detokenizer":
        from sgl_jax.srt.managers.detokenizer_manager import run_detokenizer_process as run
    else:
        raise SystemExit(f"unknown role {role!r}")
    run(server_args, port_args, status)


if __name__ == "__main__":
    main()
