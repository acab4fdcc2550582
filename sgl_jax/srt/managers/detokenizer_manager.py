"""The detokenizer process: output ids -> text, incrementally; routed experts passed through.

It never imports JAX (tested): it starts fast and holds no accelerator.

It keeps one IncrementalDecoder per unfinished request (text is final only once no later token
can change it, and a stop string is trimmed from the text) and forwards every other message
from the scheduler to the tokenizer manager unchanged.

Routed-experts rows pass through as they came: numpy arrays carried out of band in both
directions (``transport.py``), never pickled into the message, base64-encoded or copied here;
the tokenizer manager encodes them once, where it builds the response.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import zmq

from sgl_jax.srt.managers.incremental_detokenizer import IncrementalDecoder
from sgl_jax.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut
from sgl_jax.srt.managers.transport import recv_obj, send_obj
from sgl_jax.srt.server_args import PortArgs, ServerArgs
from sgl_jax.srt.tokenizer import Tokenizer
from sgl_jax.srt.utils import configure_logging, watch_parent

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        from sgl_jax.srt.configs.model_config import resolve_model_path

        path = server_args.tokenizer_path or resolve_model_path(server_args.model_path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.decoders: dict[str, IncrementalDecoder] = {}
        ctx = zmq.Context(2)
        self.recv_socket = ctx.socket(zmq.PULL)
        self.recv_socket.bind(port_args.detokenizer_ipc)
        self.send_socket = ctx.socket(zmq.PUSH)
        self.send_socket.connect(port_args.tokenizer_ipc)

    def event_loop(self) -> None:
        while True:
            msg = recv_obj(self.recv_socket)
            if isinstance(msg, BatchTokenIDOut):
                msg = self.handle_batch_token_id_out(msg)
            send_obj(self.send_socket, msg)

    def handle_batch_token_id_out(self, out: BatchTokenIDOut) -> BatchStrOut:
        texts = []
        for i, rid in enumerate(out.rids):
            decoder = self.decoders.get(rid)
            if decoder is None:
                decoder = IncrementalDecoder(
                    self.tokenizer, skip_special_tokens=out.skip_special_tokens[i],
                    stop=out.stop_strs[i],
                )
                self.decoders[rid] = decoder
            text = decoder.push(out.new_output_ids[i])
            if out.finished_reasons[i] is not None:
                if decoder.stopped_by is None:
                    text += decoder.finish()
                del self.decoders[rid]
            texts.append(text)
        return BatchStrOut(
            rids=out.rids,
            output_strs=texts,
            new_output_ids=out.new_output_ids,
            finished_reasons=out.finished_reasons,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            output_routed_experts=out.output_routed_experts or [None] * len(out.rids),
            output_routed_expert_weights=out.output_routed_expert_weights,
            weight_version=out.weight_version,
            output_logprobs=out.output_logprobs,
            first_token_times=out.first_token_times,
        )


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, pipe: Any) -> None:
    configure_logging(server_args.log_level, prefix="detokenizer")
    watch_parent()
    try:
        manager = DetokenizerManager(server_args, port_args)
        pipe.send({"status": "ready"})
    except BaseException:
        pipe.send({"status": "error", "error": traceback.format_exc()})
        raise
    try:
        manager.event_loop()
    except BaseException:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        raise
