"""Packs the scheduler's per-request progress into messages for the detokenizer and sends them:
one ``ReqOutput`` record per request, each optional feature its payload."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from sgl_jax.srt.managers.io_struct import BatchTokenIDOut
from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.managers.transport import SideSender, send_obj
from sgl_jax.srt.routed_experts_codec import (
    ROUTED_EXPERT_WEIGHTS_DTYPES,
    is_plain_cast,
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

    With a ``side`` channel (``transport.SideSender`` to the tokenizer manager), large arrays
    go there, straight to the tokenizer manager, and the message through the detokenizer
    carries references to them (sent first, by ``send``).
    """

    def __init__(
        self, socket: zmq.Socket, stream_interval: int,
        routed_rows_of: Callable[..., np.ndarray] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES, speculative: bool = False,
        side: SideSender | None = None,
    ) -> None:
        self.socket = socket
        self.side = side
        self.speculative = speculative  # each record carries its request's spec_verify_ct
        self.max_message_bytes = max_message_bytes
        self.stream_interval = stream_interval
        self.routed_rows_of = routed_rows_of
        self.weight_version = "0"  # of the served weights; set by the scheduler on an update

    def due(self, req: Req) -> bool:
        return req.finished or (
            req.stream and len(req.output_ids) - req.sent_len >= self.stream_interval
        )

    def pack(self, reqs: list[Req]) -> BatchTokenIDOut | None:
        """The message for those of ``reqs`` that are due (None if none is); marks them sent.
        Its side arrays (if any) are sent now: send the message after."""
        due = [r for r in reqs if self.due(r)]
        if not due:
            return None
        msg = self._message(due)
        if self.side is not None:
            self.side.flush()
        return msg

    def _message(self, due: list[Req]) -> BatchTokenIDOut:
        return BatchTokenIDOut.of_values(map(self._record, due), self.weight_version)

    def _record(self, req: Req) -> tuple[Any, ...]:
        """``req``'s ``ReqOutput`` since its previous message, every payload it asked for, as
        values in field order (see ``BatchTokenIDOut.of_values``)."""
        out = (
            req.rid,
            req.output_ids[req.sent_len :],  # new_ids
            req.finished_reason,
            len(req.origin_input_ids),  # prompt_tokens
            len(req.output_ids),  # completion_tokens
            req.cached_tokens,
            tuple(req.sampling_params.stop or ()),  # stop: () pickles as 1 byte, [] does not
            req.sampling_params.skip_special_tokens,
            "",  # text: the detokenizer's
            self._routed_rows(req) if req.options.return_routed_experts else None,  # routed
            None if req.logprobs is None else req.logprobs.take_new(),  # logprobs
            req.first_token_time,
            req.spec_verify_ct if self.speculative else None,
        )
        req.sent_len = len(req.output_ids)
        return out

    def _routed_rows(self, req: Req) -> tuple[np.ndarray, int, np.ndarray | None] | None:
        """The values of the ``RoutedExpertsOut`` ``req``'s message carries (see the class):
        its rows in its wire dtype, the position of the first, and their routing weights in
        their wire dtype if it asked for them; None when it carries none. Only for a request
        that asked."""
        opts = req.options
        start = opts.start_len + req.routed_sent  # the position of the first row it sends
        if req.finished:
            # All its rows [start_len, n) were gathered when it ended (a retracted one holds
            # those of before); a stream already sent the first ``routed_sent``.
            rows, weights = req.routed_experts, req.routed_expert_weights
            if rows is None:
                return None
            rows = rows[req.routed_sent :]
            weights = None if weights is None else weights[req.routed_sent :]
        elif req.stream and self.routed_rows_of is not None:
            # Rows up to seq_len - 1 are on the host: this step's were written before packing,
            # and a step still in flight only computes the position of the newest token.
            rows = self.routed_rows_of(req, start, raw=True)
            weights = (self.routed_rows_of(req, start, weights=True)
                       if opts.return_routed_expert_weights else None)
        else:
            return None
        req.routed_sent += len(rows)
        weights_dtype = ROUTED_EXPERT_WEIGHTS_DTYPES[opts.weights_dtype]
        if self.side is None:
            ids = to_wire_dtype(rows, opts.dtype)
            if weights is not None:
                weights = weights.astype(weights_dtype, copy=False)
            return ids, start, weights
        # Large ones skip the detokenizer; a plain cast is done by their copy into the
        # shared-memory arena (one pass over the rows, into memory that stays mapped).
        if is_plain_cast(rows.dtype, opts.dtype):
            ids = self.side.put(rows, wire_dtype(opts.dtype))
        else:
            ids = self.side.put(to_wire_dtype(rows, opts.dtype))
        weights = None if weights is None else self.side.put(weights, weights_dtype)
        return ids, start, weights

    def send(self, reqs: list[Req]) -> None:
        """Sends the due ones of ``reqs`` in messages of at most ``max_message_bytes`` of
        routed-experts rows (one request's rows, if larger, go alone): a burst of finishing
        requests streams out request by request, never as one giant message."""
        group: list[Req] = []
        size = 0
        for r in reqs:
            if not self.due(r):
                continue
            # Only gathered rows count (see _routed_nbytes); most requests hold none.
            n = 0 if r.routed_experts is None else _routed_nbytes(r)
            if group and size + n > self.max_message_bytes:
                self._send_message(group)
                group, size = [], 0
            group.append(r)
            size += n
        if group:
            self._send_message(group)

    def _send_message(self, group: list[Req]) -> None:
        msg = self._message(group)
        if self.side is not None:
            self.side.flush()  # before the message that refers to them
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

