"""HTTP connections that cannot be held open for free: a header deadline and a connection cap.

uvicorn closes an idle kept-alive connection after ``timeout_keep_alive``, but a connection that
sends part of a request's headers and then nothing stays open for as long as the client likes,
and every one holds a file descriptor. A few thousand such connections (slowloris) keep their
descriptors forever; ~20,000 exhaust the process's limit and ``/health`` itself can no longer be
accepted.

``guarded_h11_protocol`` builds uvicorn's h11 protocol with two rules:

- **Header deadline**: a connection has ``header_timeout`` seconds, from when it opens or from
  its previous response, to complete a request's headers; then it is closed. (Slow bodies are
  the request handler's business: the body is read with a size limit as it arrives.)
- **Connection cap**: at most ``max_connections`` are open. One more closes the connection
  that has waited longest for headers (the cheapest to lose: it has asked for nothing yet),
  or the new one if every connection is busy with a request.

And one saving: a slice of a body with a Content-Length goes to the transport as the buffer
it is (``_UnjoinedConnection``), not joined into a fresh ``bytes`` first: a MessagePack body's
arrays (``wire.Spliced``) reach the socket from the memory they arrived in.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from sgl_jax.srt.bounded_text import log_safe

logger = logging.getLogger(__name__)


def guarded_h11_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the rules above (``uvicorn.Config(http=...)``)."""

    # The connections waiting for a request's headers, the longest waiting first (a dict keeps
    # insertion order, and a connection is re-inserted when it starts waiting again): the one
    # to close for room is found in O(1), even under a flood of thousands of connections.
    waiting: dict[GuardedH11Protocol, None] = {}

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            limit = self.config.h11_max_incomplete_event_size
            self.conn = _UnjoinedConnection(
                h11.SERVER, DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()
            if len(self.connections) > max_connections:
                # Every other connection busy with a request: the new one goes.
                victim = next(iter(waiting)) if len(waiting) > 1 else self
                victim._close(f"the server holds {max_connections} connections "
                              "(--http-max-connections)")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a request's headers are complete
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._await_headers()

        def _await_headers(self) -> None:
            self._stop_waiting()
            waiting[self] = None
            self._deadline = self.loop.call_later(header_timeout, self._on_deadline)

        def _stop_waiting(self) -> None:
            waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _on_deadline(self) -> None:
            self._deadline = None
            if self in waiting:
                self._close("sent no complete request headers within "
                            f"{header_timeout:g} s (--http-header-timeout)")

        def _close(self, why: str) -> None:
            logger.debug("closing the connection of %s: %s", self.client, why)
            self._stop_waiting()
            self.transport.close()

    return GuardedH11Protocol


class _UnjoinedConnection(h11.Connection):
    """h11's connection, but ``send`` returns an event's one piece as it is: h11 joins the
    pieces of every event into a new ``bytes``, which for a Content-Length body's slice (one
    piece, the caller's own buffer) is a copy of the whole body on its way to the socket.
    Framed events (headers, chunks) have several pieces and are joined as before."""

    def send(self, event: h11.Event) -> bytes | memoryview | None:  # type: ignore[override]
        pieces = self.send_with_data_passthrough(event)
        if pieces is None:
            return None
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)



def _bound_access_args(record: logging.LogRecord) -> bool:
    if isinstance(record.args, tuple):
        record.args = tuple(log_safe(a) if isinstance(a, str) else a for a in record.args)
    return True


def bound_access_log() -> None:
    """uvicorn's access line quotes the request target (no raw control character) but copies
    all of it: every string argument of the line goes through ``log_safe`` (a path of a few
    KB becomes 200 characters and a note of its length)."""
    access = logging.getLogger("uvicorn.access")
    if _bound_access_args not in access.filters:
        access.addFilter(_bound_access_args)
