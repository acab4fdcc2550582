"""Packs the scheduler's per-request progress into messages for the detokenizer and sends them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from sgl_jax.srt.managers.io_struct import BatchTokenIDOut
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.managers.transport import send_obj
from sgl_jax.srt.routed_experts_codec import (
    ROUTED_EXPERT_WEIGHTS_DTYPES,
    to_wire_dtype,
    wire_dtype,
)

# Routed-experts bytes per message (a single larger request goes alone).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class OutputSender:
    """A request's new output ids go out when it finishes, or, streaming, every
    ``stream_interval`` tokens; ``req.sent_len`` remembers what has been sent.

    Routed experts leave here in the request's wire dtype (cast once). A streamed request's
    message carries the rows completed since its previous one (``req.routed_sent`` counts
    them), read through ``routed_rows_of(req, start)``; any other request's rows go with its
    final message only. Routing weights (``return_routed_expert_weights``) go alongside their
    rows, by the same rules, in their wire float dtype.
    """

    def __init__(
        self, socket: zmq.Socket, stream_interval: int,
        routed_rows_of: Callable[..., np.ndarray] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.socket = socket
        self.max_message_bytes = max_message_bytes
        self.stream_interval = stream_interval
        self.routed_rows_of = routed_rows_of
        self.weight_version = "0"  # of the served weights; set by the scheduler on an update

    def due(self, req: Req) -> bool:
        return req.finished or (
            req.stream and len(req.output_ids) - req.sent_len >= self.stream_interval
        )

    def pack(self, reqs: list[Req]) -> BatchTokenIDOut | None:
        """The message for those of ``reqs`` that are due (None if none is); marks them sent."""
        out = [r for r in reqs if self.due(r)]
        if not out:
            return None
        msg = BatchTokenIDOut(
            rids=[r.rid for r in out],
            new_output_ids=[r.output_ids[r.sent_len :] for r in out],
            finished_reasons=[r.finished_reason for r in out],
            prompt_tokens=[len(r.origin_input_ids) for r in out],
            completion_tokens=[len(r.output_ids) for r in out],
            cached_tokens=[r.cached_tokens for r in out],
            stop_strs=[list(r.sampling_params.stop or []) for r in out],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in out],
            weight_version=self.weight_version,
            output_logprobs=[None if r.logprobs is None else r.logprobs.take_new() for r in out],
            first_token_times=[r.first_token_time for r in out],
        )
        routed = [self._routed_rows(r) for r in out]
        msg.output_routed_experts = [ids for ids, _ in routed]
        msg.output_routed_expert_weights = [weights for _, weights in routed]
        for r in out:
            r.sent_len = len(r.output_ids)
        return msg

    def _routed_rows(self, req: Req) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The rows ``req``'s message carries (see the class), in its wire dtype, and their
        routing weights (None unless it asked for them)."""
        opts = req.options
        if not opts.return_routed_experts:
            return None, None
        if req.finished:
            # All its rows [start_len, n) were gathered when it ended (a retracted one holds
            # those of before); a stream already sent the first ``routed_sent``.
            rows, weights = req.routed_experts, req.routed_expert_weights
            if rows is None:
                return None, None
            rows = rows[req.routed_sent :]
            weights = None if weights is None else weights[req.routed_sent :]
        elif req.stream and self.routed_rows_of is not None:
            # Rows up to seq_len - 1 are on the host: this step's were written before packing,
            # and a step still in flight only computes the position of the newest token.
            start = opts.start_len + req.routed_sent
            rows = self.routed_rows_of(req, start, raw=True)
            weights = (self.routed_rows_of(req, start, weights=True)
                       if opts.return_routed_expert_weights else None)
        else:
            return None, None
        req.routed_sent += len(rows)
        if weights is not None:
            weights = weights.astype(ROUTED_EXPERT_WEIGHTS_DTYPES[opts.weights_dtype])
        return to_wire_dtype(rows, opts.dtype), weights

    def send(self, reqs: list[Req]) -> None:
        """Sends the due ones of ``reqs`` in messages of at most ``max_message_bytes`` of
        routed-experts rows (one request's rows, if larger, go alone): a burst of finishing
        requests streams out request by request, never as one giant message."""
        group: list[Req] = []
        size = 0
        for r in reqs:
            n = _routed_nbytes(r)
            if group and size + n > self.max_message_bytes:
                self._send_msg(self.pack(group))
                group, size = [], 0
            group.append(r)
            size += n
        if group:
            self._send_msg(self.pack(group))

    def _send_msg(self, msg: BatchTokenIDOut | None) -> None:
        if msg is not None:
            send_obj(self.socket, msg)

    def send_control(self, msg: Any) -> None:
        """A reply to a control request (flush, server info), passed on by the detokenizer."""
        send_obj(self.socket, msg)


def _routed_nbytes(req: Req) -> int:
    """The routed-experts bytes ``req``'s next message carries (its gathered rows in its wire
    dtype, and their weights; a stream's few new rows are not counted)."""
    rows, weights = req.routed_experts, req.routed_expert_weights
    if not req.finished or rows is None:
        return 0
    ids = rows.size * wire_dtype(req.options.dtype).itemsize  # as sent, not as stored
    return ids + (0 if weights is None else weights.nbytes)
