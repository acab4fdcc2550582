"""The detokenizer process: output ids -> text, incrementally.

It never imports JAX (tested): it starts fast and holds no accelerator.

It keeps one IncrementalDecoder per unfinished request (text is final only once no later token
can change it, and a stop string is trimmed from the text), fills the ``text`` of each
``ReqOutput`` record (on the batch's columns) and forwards every other message from the
scheduler to the tokenizer manager unchanged.

It reads nothing of a record but its ids, stop strings and ``skip_special_tokens``: every
feature's payload passes through as it came, its numpy arrays out of band in both directions
(``transport.py``), never pickled into the message, encoded or copied here. Large arrays
the scheduler sent on the side channel (straight to the tokenizer manager) are not here at
all: the records hold ``transport.SideArray`` references, unpickled and pickled again as such.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Sequence
from typing import Any

import zmq

from sgl_jax.srt.managers.incremental_detokenizer import IncrementalDecoder
from sgl_jax.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut
from sgl_jax.srt.managers.transport import recv_obj, send_obj
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.srt.utils import configure_logging, report_startup, watch_parent

logger = logging.getLogger(__name__)

# How often an idle loop looks at its stop event (single-process mode's shutdown latency).
STOP_POLL_MS = 100


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        from sgl_jax.srt.configs.model_config import resolve_model_path

        path = server_args.tokenizer_path or resolve_model_path(server_args.model_path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.decoders: dict[str, IncrementalDecoder] = {}
        self.ctx = ctx = zmq.Context(2)
        self.recv_socket = ctx.socket(zmq.PULL)
        self.recv_socket.bind(port_args.detokenizer_ipc)
        self.send_socket = ctx.socket(zmq.PUSH)
        self.send_socket.connect(port_args.tokenizer_ipc)

    def event_loop(self, stop: threading.Event | None = None) -> None:
        """Forwards messages until ``stop`` is set (a thread of the caller's process) or
        forever (its own process)."""
        stop = stop or threading.Event()
        while not stop.is_set():
            if not self.recv_socket.poll(timeout=STOP_POLL_MS):
                continue
            msg = recv_obj(self.recv_socket)
            if isinstance(msg, BatchTokenIDOut):
                msg = self.handle_batch_token_id_out(msg)
            send_obj(self.send_socket, msg)

    def close(self) -> None:
        """Releases the sockets; from the loop's thread, once it has stopped."""
        self.recv_socket.close(linger=0)
        self.send_socket.close(linger=0)
        self.ctx.term()

    def handle_batch_token_id_out(self, out: BatchTokenIDOut) -> BatchStrOut:
        # Column by column: the records are never built here (see _OutputBatch).
        texts = list(map(self._text_delta, *out.columns(
            "rid", "new_ids", "finish_reason", "stop", "skip_special_tokens")))
        return out.with_text(texts)

    def _text_delta(self, rid: str, new_ids: list[int], finish_reason: dict[str, Any] | None,
                    stop: Sequence[str], skip_special_tokens: bool) -> str:
        """The text that became final with a request's new ids (all that is left if it
        ended)."""
        decoder = self.decoders.get(rid)
        if decoder is None:
            decoder = IncrementalDecoder(self.tokenizer, skip_special_tokens=skip_special_tokens,
                                         stop=stop)
            self.decoders[rid] = decoder
        text = decoder.push(new_ids)
        if finish_reason is not None:
            if decoder.stopped_by is None:
                text += decoder.finish()
            del self.decoders[rid]
        return text


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    configure_logging(server_args.log_level, prefix="detokenizer")
    watch_parent()
    manager = report_startup(pipe, lambda: DetokenizerManager(server_args, port_args))
    try:
        manager.event_loop()
    except BaseException:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        raise
